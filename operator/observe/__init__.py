"""Reading the world: the Kubernetes API, the Hugging Face Hub, the engines' /metrics."""
