"""Where results land: Pub/Sub and BigQuery writers. In: completions, chunks and dead letters; out: published messages,
table rows, and rejected rows as dead letters.
"""
