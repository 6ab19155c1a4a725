"""Text handling: tokenizer, incremental detokenizer, stop strings, chat templates."""
