"""What every stage shares, at the ground: the request, chunk, completion and dead-letter records, structured answers,
chunk cutting, request keys, the state-cell format and the element guard.
"""

# Beam's coder for InferenceRequest is registered wherever any record of the contract is in use.
import pipeline.contract.request_coder  # noqa: E402,F401
