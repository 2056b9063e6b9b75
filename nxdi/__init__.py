"""nxdi: LLM inference for AWS Trainium and Inferentia, with a CPU backend that matches transformers."""
