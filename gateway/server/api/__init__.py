"""The client API: OpenAI and SGLang-native handlers, request schemas, response formats, tokenizer,
chat template, auth, middleware and the errors clients see."""
