"""Where results land: Pub/Sub and BigQuery writers. In: completions, chunks and dead letters; out: published messages,
table rows, and rejected rows as dead letters. The engine publishes chunks through one of them as they are cut
(``chunk_publisher``), so the sinks sit just above the records, below every stage that writes.
"""
