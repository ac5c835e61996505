"""Policy models and tokenizers: local Hugging Face folders and the built-in tiny model."""
