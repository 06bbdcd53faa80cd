"""From Pub/Sub message to a measured request: parsing, template defaults, prompt length. In: Pub/Sub messages; out:
requests with their token counts, and dead letters.
"""
