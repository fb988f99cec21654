"""A stand-in for the guard's pytest plugin: changes nothing, wraps nothing.

`KVLIFETIME_VLLM_PLUGIN=empty_plugin make test-vllm` runs the guarded mode's machinery (the
comparison with expected-outcomes.json, the wrapped-connector count) before the real plugin,
kvlifetime.integrations.vllm.pytest_plugin, exists. Guarded and unguarded runs must agree.
"""
