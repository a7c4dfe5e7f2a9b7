"""The client API: OpenAI and SGLang-native handlers, the gateway's request bounds, response formats,
tokenizer, chat template, auth and per-key limits (admission, ratelimit), the HTTP server under it
(http_server: parser errors, read deadlines), /openapi.json, middleware and the errors clients see.
The wire shapes it shares with
the workers' OpenAI routes (error bodies, field reads, request parsing, envelopes, chat messages) are
gateway.protocol.openai's."""
