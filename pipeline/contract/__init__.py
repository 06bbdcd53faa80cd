"""What every stage shares, at the ground: the request, chunk, completion and dead-letter records, structured answers,
chunk cutting, request keys, the state-cell format and the element guard.
"""
