"""Telemetry: metrics, request spans and structured logs; nothing here runs on the engine thread but the
metric hooks."""
