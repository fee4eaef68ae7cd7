"""The model as the runtime holds it: replicas, flavors, vLLM, file references, usage."""
