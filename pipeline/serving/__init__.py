"""The model and its server: where weights are and how a worker gets them (token, adapters), and the vLLM server
process. In: a model id or folder; out: a running server.
"""
