"""``make bench``: the template against raw vLLM and Beam's vLLM handler, side by side in one run.

The data path of a run: :mod:`.workload` makes the seeded prompts and their
arrival times; :mod:`.cores` pins the server and the pipelines to their cores;
:mod:`.systems` sends the same prompts through each system and records, per
request, when it was sent, when its first text and its end reached the
client, and (for the template) the records' own timestamps;
:mod:`.stats` turns those into percentiles, hop breakdowns and ratios;
:mod:`.report` prints the table and writes Markdown, JSON and plots. The
command itself is :mod:`.__main__`.
"""
