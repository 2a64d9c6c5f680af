"""Text around the engine's token ids: the tokenizer and chat template (`tokenizer`), the
incremental detokenizer and stop strings (`detokenizer`). No torch."""
