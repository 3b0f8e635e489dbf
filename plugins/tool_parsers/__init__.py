"""Built-in tool-call parsers, one module per model family (registered through `register_tool_parsers`)."""
