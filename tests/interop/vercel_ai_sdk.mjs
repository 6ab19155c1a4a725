// The Vercel AI SDK (`ai`, with its OpenAI-compatible provider) against the HTTP API: a chat, a
// stream, structured output in the SDK's default mode and a tool-calling round trip whose first
// step forces the tool (the tiny default model rarely chooses one itself) and whose second answers.
//
// Usage: node tests/interop/vercel_ai_sdk.mjs BASE_URL MODEL
//
// Prints one JSON object with what each call returned. Exit code 0 when every call returned.
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { generateObject, generateText, stepCountIs, streamText, tool } from "ai";
import { z } from "zod";

const [baseURL, modelName] = process.argv.slice(2);
// The server enforces JSON Schemas (response_format json_schema), which the provider is told, as
// for any OpenAI-compatible server that does; without it the SDK asks for any JSON object.
const provider = createOpenAICompatible({
  name: "tokenwire",
  baseURL,
  apiKey: "unused",
  supportsStructuredOutputs: true,
});
const model = provider(modelName);
const settings = { model, temperature: 0, maxOutputTokens: 48, maxRetries: 0 };

const chat = await generateText({ ...settings, prompt: "Name a colour." });

const streamed = streamText({ ...settings, prompt: "Name a colour." });
let streamText_ = "";
let chunks = 0;
for await (const delta of streamed.textStream) {
  streamText_ += delta;
  chunks += 1;
}

const person = await generateObject({
  ...settings,
  schema: z.object({ name: z.string(), age: z.number().int() }),
  prompt: "Describe a person called Ada, aged 36.",
});

const weather = tool({
  description: "The current weather in a city.",
  inputSchema: z.object({ city: z.string() }),
  execute: async () => "18 degrees Celsius and sunny",
});
const roundTrip = await generateText({
  ...settings,
  tools: { get_weather: weather },
  prompt: "What is the weather in Paris?",
  prepareStep: ({ stepNumber }) =>
    stepNumber === 0 ? { toolChoice: { type: "tool", toolName: "get_weather" } } : { toolChoice: "none" },
  stopWhen: stepCountIs(2),
});

console.log(
  JSON.stringify({
    chat: { text: chat.text, finishReason: chat.finishReason, outputTokens: chat.usage.outputTokens },
    stream: { text: streamText_, chunks, finishReason: await streamed.finishReason },
    object: person.object,
    roundTrip: {
      steps: roundTrip.steps.map((step) => ({
        finishReason: step.finishReason,
        toolCalls: step.toolCalls.map((call) => ({ name: call.toolName, input: call.input })),
        toolResults: step.toolResults.map((result) => result.output),
        text: step.text,
      })),
    },
  }),
);
