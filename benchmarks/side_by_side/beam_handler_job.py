"""Beam's ``RunInference`` + ``VLLMCompletionsModelHandler`` behind Pub/Sub in and out: the peer.

Run as its own process, like the template, so that its CPU time and memory
are measured the same way. The handler is Beam 2.77's, unchanged (its
batching, its non-streaming requests, one ``inference_args`` for every
element), except that ``load_model`` points it at the benchmark's shared
server instead of starting a server of its own. Each answer is published as
``{"id", "tokens"}``: for this handler the whole completion is the first
output.

    python -m benchmarks.side_by_side.beam_handler_job --input_subscription=... --output_topic=... \
        --port=8000 --model=NAME --max_tokens=96 [--min_tokens=96]

``--min_tokens`` (vLLM's, through the OpenAI client's ``extra_body``) fixes
every answer's length for runs that compare equal work.
"""

from __future__ import annotations

import argparse
import json
import logging

import apache_beam as beam
from apache_beam.io.gcp.pubsub import ReadFromPubSub
from apache_beam.ml.inference.base import KeyedModelHandler, RunInference
from apache_beam.ml.inference.vllm_inference import VLLMCompletionsModelHandler
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

from local.direct_runner import apply_local_runner_fixes
from pipeline.sinks.pubsub_sink import PublishJson


class _SharedServer:
    """What Beam's handler gets from ``load_model``: the address of the shared server."""

    def __init__(self, port: int) -> None:
        self._port = port

    def get_server_port(self) -> int:
        return self._port

    def check_connectivity(self) -> None:
        pass


class HandlerOnSharedServer(VLLMCompletionsModelHandler):
    """Beam's handler, using the benchmark's server instead of starting one."""

    def __init__(self, model_name: str, port: int) -> None:
        super().__init__(model_name)
        self._shared_port = port

    def load_model(self) -> _SharedServer:
        return _SharedServer(self._shared_port)


def _keyed(data: bytes) -> tuple[str, str]:
    message = json.loads(data)
    return message["id"], message["prompt"]


def _answer(keyed) -> dict:
    key, result = keyed
    return {"id": key, "tokens": result.inference.usage.completion_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input_subscription", required=True)
    parser.add_argument("--output_topic", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--max_tokens", type=int, required=True)
    parser.add_argument("--min_tokens", type=int, help="vLLM's min_tokens for every element (default: none)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    options = PipelineOptions(flags=[], runner="BundleBasedDirectRunner")
    options.view_as(StandardOptions).streaming = True
    apply_local_runner_fixes()
    inference_args = {"max_tokens": args.max_tokens, "temperature": 0}
    if args.min_tokens is not None:
        inference_args["extra_body"] = {"min_tokens": args.min_tokens}
    pipeline = beam.Pipeline(options=options)
    (pipeline
     | ReadFromPubSub(subscription=args.input_subscription)
     | beam.Map(_keyed)
     | RunInference(KeyedModelHandler(HandlerOnSharedServer(args.model, args.port)),
                    inference_args=inference_args)
     | beam.Map(_answer)
     | PublishJson(args.output_topic))
    pipeline.run().wait_until_finish()


if __name__ == "__main__":
    main()
