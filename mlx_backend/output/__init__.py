"""A reply's tokens turned into text, reasoning and tool calls, and events."""
