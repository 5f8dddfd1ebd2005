"""Reading: the children and pods (through kube.py), Secrets, the Hugging Face Hub, the engines' /metrics."""
