"""Tool calling: one parser per model family's call syntax (parsers.py), chosen from the chat
template (select.py); the request fields tools / tool_choice / response_format (request.py); and
tool calls streamed as OpenAI streams them (streaming.py)."""
