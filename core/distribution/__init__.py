"""Sources a model is pulled from into the store, one module each (the Hugging Face Hub: huggingface)."""
