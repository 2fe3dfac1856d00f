"""Build the model pairs dflash-serve ships and tests with: corpus, tokenizer, test pair, training."""
