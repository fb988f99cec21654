"""Integrations with serving engines (optional extras): ``kvlifetime.integrations.vllm``."""
