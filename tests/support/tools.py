"""The one tool the tool-calling tests offer, in OpenAI's request shape."""

from __future__ import annotations

WEATHER_RESULT = "18 degrees Celsius and sunny"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
"""tool_choice naming the weather tool: exactly one call of it, forced by the server's grammar."""
