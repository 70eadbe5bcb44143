"""Qwen3 and Llama3 through torchtitan's model definitions, loaded from / saved to local HF folders."""
