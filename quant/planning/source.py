"""Which files of a Hub repository a run reads: the weights, the JSON configs and the tokenizer's files."""

HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "tokenizer*"]
