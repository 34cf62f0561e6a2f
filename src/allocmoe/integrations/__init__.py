"""allocmoe plans in other engines: the vLLM plugin (`vllm_plugin`) and `export` of engine settings."""
