"""The model behind the loop: the OpenAI-compatible adapter and the HTTP client under it."""
