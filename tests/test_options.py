"""Template parameters: validation, launcher-style string values, and metadata.json parity."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from local.template_docs import DOCS, PARAMETERS_PAGE, metadata_json, page_with_parameters
from pipeline.config.options import ConfigError, PipelineConfig
from pipeline.config.settings import JobSettings
from pipeline.contract.chunking import ChunkPolicy
from pipeline.contract.parameter_checks import CHECKED_BY_RECORDS, ENGINE_RECORDS, NOT_WITH_TRANSFORMERS
from pipeline.contract.parameters import DEFAULT_HARNESS_THREADS, PARAMETERS, PARAMETERS_BY_NAME, WORKER_OPTIONS
from pipeline.contract.request_parsing import RequestLimits
from pipeline.engines.engine_settings import EngineSettings
from pipeline.flow.batching import BatchingConfig
from pipeline.generation.generate import StreamingGenerate
from pipeline.generation.generate_settings import GenerateSettings
from pipeline.serving.adapter_root import AdapterRoot
from pipeline.serving.vllm_server import ServerSpec
from pipeline.worker.runtime_client import call_threads
from pipeline.worker.runtime_settings import AdmissionSettings, CallSettings

REPO = Path(__file__).resolve().parent.parent
BASE = {
    "input_subscription": "projects/my-project/subscriptions/prompts-sub",
    "output_chunks_topic": "projects/my-project/topics/chunks",
    "dead_letter_topic": "projects/my-project/topics/dead",
}


def config(**overrides):
    return PipelineConfig.from_mapping({**BASE, **overrides})


def settings(**overrides):
    return JobSettings.from_mapping({**BASE, **overrides})


def test_defaults_are_typed_and_sensible():
    cfg = config()
    assert (cfg.max_batch_delay_ms, cfg.batch_size_target) == (10, 4)
    assert settings().batching.boundaries == ()  # arrival order unless opted in
    assert cfg.prompt_format == "chat" and cfg.server_url is None and cfg.gpu_memory_utilization == 0.9


def test_launcher_strings_are_converted():
    # The Flex Template launcher passes every value as a string.
    options = PipelineOptions([f"--{k}={v}" for k, v in BASE.items()] + [
        "--max_batch_delay_ms=25", "--gpu_memory_utilization=0.8", "--vllm_args=--enforce-eager --seed 3"])
    cfg = PipelineConfig.from_options(options)
    assert cfg.max_batch_delay_ms == 25 and cfg.gpu_memory_utilization == 0.8
    assert cfg.extra_vllm_args == ["--enforce-eager", "--seed", "3"]


@pytest.mark.parametrize("overrides, message", [
    ({"input_subscription": None}, "--input_subscription is required"),
    ({"input_subscription": "prompts-sub"}, "--input_subscription='prompts-sub' is not valid"),
    ({"output_chunks_topic": None}, "no output is configured"),
    ({"dead_letter_topic": None}, "no dead-letter output is configured. Also required: where answers go"),
    ({"output_completions_table": "my-project:llm"}, "--output_completions_table='my-project:llm' is not valid"),
    ({"batch_size_target": "0"}, "--batch_size_target must be at least 1"),
    ({"length_bucketing": "true", "bucket_boundaries": "128,64"}, "must be strictly increasing"),
    ({"length_bucketing": "true", "bucket_boundaries": "0,64"}, "must be positive token counts"),
    ({"length_bucketing": "true", "bucket_boundaries": "a,b"}, "--bucket_boundaries='a,b' is not valid"),
    ({"length_bucketing": "true", "answer_bucket_boundaries": "64,16"}, "answer bucket boundaries must be strictly"),
    ({"length_bucketing": "true", "answer_bucket_boundaries": "16,all"}, "--answer_bucket_boundaries='16,all' is not"),
    ({"length_bucketing": "maybe"}, "expected true or false"),
    ({"max_batch_delay_ms": "-1"}, "--max_batch_delay_ms must be at least 0"),
    ({"max_batch_delay_ms": "ten"}, "expected a whole number"),
    ({"prompt_format": "xml"}, "--prompt_format must be one of chat, completion"),
    ({"server_url": "vllm:8000"}, "--server_url='vllm:8000' is not valid"),
    ({"default_max_tokens": "4096"}, "--default_max_tokens (4096) must be below --max_model_len"),
    ({"engine": "tgi"}, "--engine must be one of vllm, transformers"),
    ({"engine": "transformers", "server_url": "http://vllm:8000"}, "--server_url does not go with --engine=transformers"),
    ({"engine": "transformers", "response_schema": '{"type": "object"}'},
     "--response_schema does not go with --engine=transformers: it cannot constrain answers"),
    ({"engine": "transformers", "generate_shards": "64"}, "--generate_shards does not go with --engine=transformers"),
    ({"engine": "transformers", "batch_size_target": "8", "max_in_flight": "4"},
     "--batch_size_target (8) must be at most --max_in_flight (4) with --engine=transformers"),
    ({"vllm_args": "--enforce-eager --max-model-len 8192"},
     "--vllm_args sets --max-model-len, which the template sets itself; use --max_model_len instead"),
    ({"vllm_args": "--max_model_len=8192"}, "--vllm_args sets --max_model_len, which the template sets itself"),
    ({"vllm_args": "--dtype float16"}, "use --dtype instead"),
    ({"vllm_args": "--port 9000"}, "--vllm_args sets --port, which the template sets itself"),
    ({"vllm_args": "--enforce-eager '--unclosed"}, "--vllm_args cannot be split into flags"),
    ({"vllm_args": "--scheduling-policy fcfs"},
     "--vllm_args sets --scheduling-policy fcfs, but with prioritize_short_prompts the template sends each request"),
    ({"vllm_args": "--scheduling_policy=fcfs", "prioritize_short_prompts": "false",
      "bulk_subscription": "projects/my-project/subscriptions/backfill-sub"},
     "--scheduling-policy fcfs, but with a bulk_subscription the template sends each request a vLLM priority"),
    ({"engine": "transformers", "bulk_subscription": "projects/my-project/subscriptions/backfill-sub"},
     "--bulk_subscription does not go with --engine=transformers: it generates each batch whole, in the order"),
    ({"number_of_worker_harness_threads": "1"}, "number_of_worker_harness_threads must be at least 2"),
    ({"number_of_worker_harness_threads": "many"}, "number_of_worker_harness_threads: expected a whole number"),
])
def test_bad_configuration_fails_with_a_message_that_says_what_to_change(overrides, message):
    with pytest.raises(ConfigError) as excinfo:
        settings(**overrides)
    assert message in str(excinfo.value)


def test_bigquery_tables_alone_are_enough_outputs():
    cfg = PipelineConfig.from_mapping({"input_subscription": BASE["input_subscription"],
                                       "output_completions_table": "my-project:llm.completions",
                                       "dead_letter_table": "my-project.llm.dead_letters"})
    assert cfg.output_chunks_topic is None and cfg.bigquery_create_tables is True


def test_length_bucketing_defaults_to_powers_of_two_below_the_context():
    assert settings(length_bucketing="true", max_model_len="1024").batching.boundaries == (32, 64, 128, 256, 512)
    assert settings(length_bucketing="true", bucket_boundaries=" 10, 200 ").batching.boundaries == (10, 200)


def test_answer_buckets_default_on_for_the_static_engine_only():
    """A static batch runs until its longest answer; vLLM's continuous batching pads nothing."""
    static = settings(length_bucketing="true", engine="transformers", max_model_len="1024",
                      default_max_tokens="100").batching
    assert static.answer_boundaries == (16, 32, 64, 128, 256, 512)
    assert static.bucket_name(20, None) == "0.3"  # no max_tokens: the default answer budget, 100
    assert static.bucket_name(20, 8) == "0.0" and static.bucket_name(300, 600) == "4.6"
    assert settings(length_bucketing="true").batching.answer_boundaries == ()
    assert settings(length_bucketing="true", engine="transformers",
                    answer_bucket_boundaries="none").batching.answer_boundaries == ()
    assert settings(length_bucketing="true", answer_bucket_boundaries="8, 64").batching.answer_boundaries == (8, 64)
    assert settings(engine="transformers").batching.answer_boundaries == ()  # arrival order: one bucket


def test_length_estimator_auto_uses_the_tokenizer_only_with_a_managed_server():
    assert settings().prompt_length.estimator == "tokenizer"
    assert settings(server_url="http://127.0.0.1:8000").prompt_length.estimator == "chars"
    assert settings(server_url="http://127.0.0.1:8000", length_estimator="tokenizer").prompt_length.estimator == \
        "tokenizer"


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as excinfo:
        settings(batch_size_target="0", max_batch_delay_ms="-5")
    assert "batch_size_target" in str(excinfo.value) and "max_batch_delay_ms" in str(excinfo.value)


def test_every_parameter_acts_and_is_read_only_where_configuration_becomes_settings():
    """A parameter that does nothing does not exist, and it travels forward: read from the config (or through one of
    its properties) in the room that builds the components' settings, the launch checks, or assembly's wiring of
    the input and outputs; the components get settings, never the config."""
    readers = {path: path.read_text(encoding="utf-8") for path in (REPO / "pipeline").rglob("*.py")
               if path.name != "options.py"}
    inside = (REPO / "pipeline" / "config" / "options.py").read_text(encoding="utf-8")
    code = "\n".join(readers.values())
    unread = [p.name for p in PARAMETERS
              if not re.search(rf"config\.{p.name}\b", code)
              and not re.search(rf"self\.{p.name}\b", inside)]  # read through a PipelineConfig property
    assert not unread, f"parameters no step reads: {unread}"
    rooms = {REPO / "pipeline" / "config" / "settings.py", REPO / "pipeline" / "config" / "launch_checks.py",
             REPO / "pipeline" / "assembly.py"}
    elsewhere = sorted(path.relative_to(REPO).as_posix() for path, text in readers.items()
                       if path not in rooms and re.search(r"\bPipelineConfig\b", text))
    assert not elsewhere, f"modules that read the config instead of their settings: {elsewhere}"


def test_components_default_to_what_the_parameters_declare():
    """Defaults are written once, in PARAMETERS: a job with every parameter unset builds the components' own
    defaults, field for field."""
    job = settings()
    assert job.batching == BatchingConfig()
    assert job.limits == RequestLimits()
    assert job.engine.chunk_policy == ChunkPolicy()
    bare_engine = EngineSettings(server=job.engine.server)
    for name in ("engine", "prompt_format", "max_in_flight", "request_timeout_s", "stream_lease_s", "live_reserve"):
        assert getattr(job.engine, name) == getattr(bare_engine, name), name
    assert job.admission.worker_queue == AdmissionSettings().worker_queue
    assert job.calls.harness_threads == CallSettings().harness_threads
    spec, bare_spec = job.engine.server, ServerSpec(model=job.engine.server.model)
    for name in ("max_model_len", "dtype", "gpu_memory_utilization", "start_timeout_s", "max_lora_rank", "max_loras"):
        assert getattr(spec, name) == getattr(bare_spec, name), name
    assert job.generate == GenerateSettings()
    assert job.config.max_in_flight == PARAMETERS_BY_NAME["max_in_flight"].default == bare_engine.max_in_flight


def test_the_runtime_client_keeps_a_call_thread_for_each_harness_thread_the_launch_sets():
    assert call_threads(settings(number_of_worker_harness_threads="8").calls) == 8 + 2
    assert call_threads(settings().calls) == DEFAULT_HARNESS_THREADS + 2
    options = PipelineOptions([f"--{k}={v}" for k, v in BASE.items()] + ["--number_of_worker_harness_threads=20"])
    assert call_threads(JobSettings.from_options(options).calls) == 20 + 2


def test_a_value_given_to_the_launcher_reaches_the_config_converted():
    for param in PARAMETERS:
        if param.example is None or param.name in BASE:
            continue
        values = {**BASE, param.name: str(param.example)}
        try:
            config_ = PipelineConfig.from_mapping(values)
        except ConfigError:
            continue  # an example that needs a companion parameter (checked by the combination tests)
        assert getattr(config_, param.name) == param.convert(str(param.example)), param.name


def test_the_console_help_states_each_default_and_names_no_make_target():
    """The console shows helpText beside an empty field: its default must be there, and a console user has no make."""
    targets = set(re.findall(r"(?m)^([a-z][-a-z0-9]*):", (REPO / "Makefile").read_text(encoding="utf-8")))
    assert {"image", "template", "bench-engines"} <= targets
    for entry in json.loads(metadata_json())["parameters"]:
        if "defaultValue" in entry:
            assert f"Default: {entry['defaultValue']}." in entry["helpText"], entry["name"]
        named = {target for target in re.findall(r"\bmake ([-a-z0-9]+)", entry["helpText"]) if target in targets}
        assert not named, (entry["name"], named)


def test_metadata_json_is_generated_from_the_parameters():
    committed = (REPO / "metadata.json").read_text()
    assert committed == metadata_json(), "metadata.json is stale: run `make metadata`"


def test_metadata_has_what_gcloud_and_the_console_need():
    metadata = json.loads(metadata_json())
    assert metadata["name"] and metadata["description"] and metadata["streaming"] is True
    assert metadata["defaultStreamingMode"] in ("AT_LEAST_ONCE", "EXACTLY_ONCE")
    by_name = {p.name: p for p in (*PARAMETERS, *WORKER_OPTIONS)}
    assert [p["name"] for p in metadata["parameters"]] == list(by_name)
    for entry in metadata["parameters"]:
        param = by_name[entry["name"]]
        assert entry["label"].strip() and entry["helpText"].strip() and entry["groupName"].strip()
        assert entry["isOptional"] is (not param.required)
        for regex in entry.get("regexes", []):
            pattern = re.compile(regex)
            assert pattern.match(param.example), (param.name, param.example)
            assert not pattern.match("not a valid value !"), param.name
            if "defaultValue" in entry:
                assert pattern.match(entry["defaultValue"]), (param.name, entry["defaultValue"])
            if param.minimum is not None and param.minimum >= 0:  # the form refuses what the launcher would
                assert not pattern.match("-1"), param.name
        if param.param_type == "ENUM":
            assert [o["value"] for o in entry["enumOptions"]] == list(param.enum_options)


def test_the_worker_options_the_form_shows_are_beams_own():
    """The console passes them as --name=value like any parameter; Beam must read them as its own options."""
    for option in WORKER_OPTIONS:
        parsed = PipelineOptions([f"--{option.name}={option.example}"]).get_all_options()
        assert str(parsed[option.name]) == option.example
        assert option.name not in PipelineConfig.__dataclass_fields__


def test_the_docs_parameter_table_is_generated_from_the_parameters():
    page = (DOCS / PARAMETERS_PAGE).read_text()
    assert page_with_parameters(page) == page, "docs/parameters.md is stale: run `make metadata`"


def test_records_built_without_the_options_hold_the_parameters_bounds():
    """A settings record made in code (the transforms' API) is checked against the same declaration as the options."""
    engine = dict(server=None, server_url="http://127.0.0.1:1")
    for kwargs, message in ((dict(stream_lease_s=0), "--stream_lease_s must be at least 1"),
                            (dict(engine="tgi"), "--engine must be one of vllm, transformers"),
                            (dict(max_in_flight=5000), "--max_in_flight must be at most 4096")):
        with pytest.raises(ValueError, match=message):
            EngineSettings(**engine, **kwargs)
    with pytest.raises(ValueError, match="--worker_queue must be at least 1"):
        AdmissionSettings(worker_queue=0)
    with pytest.raises(ValueError, match="--number_of_worker_harness_threads must be at least 2"):
        CallSettings(harness_threads=0)
    with pytest.raises(ValueError, match="--num_shards must be at least 1"):
        BatchingConfig(num_shards=0)
    with pytest.raises(ValueError, match="--drain_timeout_s must be at least 0"):
        GenerateSettings(drain_timeout_s=-1)
    with pytest.raises(ValueError, match="--generate_shards must be at least 1"):
        GenerateSettings(generate_shards=0)
    with pytest.raises(ValueError, match="--generate_shards does not go with --engine=transformers"):
        GenerateSettings(generate_shards=8, engine="transformers")
    with pytest.raises(ValueError, match="--server_url does not go with --engine=transformers"):
        EngineSettings(**engine, engine="transformers")


def test_the_generate_step_refuses_settings_built_for_another_engine():
    transformers = EngineSettings(server=ServerSpec(model="m"), engine="transformers")
    assert StreamingGenerate(transformers)._generate == GenerateSettings(engine="transformers")
    with pytest.raises(ValueError, match="settings are for engine 'vllm', its runtime's for 'transformers'"):
        StreamingGenerate(transformers, GenerateSettings())


# A value each parameter's declaration refuses, as a launch passes it (a string).
def _refused(name: str) -> str:
    param = PARAMETERS_BY_NAME[name]
    if param.enum_options:
        return "not-one-of-them"
    if param.regex:
        return "not valid !"
    assert param.minimum is not None, name
    return str(param.minimum - 1) if param.param_type == "NUMBER" and param.minimum >= 1 else "-1"


# How a test builds each record with one field set, by parameter name (the field's name where it differs).
RECORDS = {
    "EngineSettings": lambda **kw: EngineSettings(**({"server": None, "server_url": "http://127.0.0.1:1"} | kw)),
    "BatchingConfig": BatchingConfig, "AdmissionSettings": AdmissionSettings, "GenerateSettings": GenerateSettings,
    "AdapterRoot": AdapterRoot,
}
FIELDS = {"batch_token_budget": "token_budget", "lora_adapter_root": "location"}


@pytest.mark.parametrize("name", [p.name for p in PARAMETERS if p.enum_options or p.regex or p.minimum is not None])
def test_a_launch_reports_each_refused_value_once_from_the_check_that_owns_it(name):
    """Each value is checked once: by the record that owns it (CHECKED_BY_RECORDS), which a pipeline of one's own
    builds too, or else by the options; a launch lists the problem once, with the rest."""
    value = _refused(name)
    with pytest.raises(ConfigError) as excinfo:
        settings(**{name: value, "batch_size_target": "0" if name != "batch_size_target" else value})
    message = str(excinfo.value)
    assert message.count(f"--{name} must") + message.count(f"--{name}={value!r} is not valid") == 1, message
    assert "--batch_size_target must be at least 1" in message  # and every other problem with it
    owner = CHECKED_BY_RECORDS.get(name)
    if owner is None:
        with pytest.raises(ConfigError, match=f"--{name}"):
            config(**{name: value})
        return
    config(**{name: value})  # the options leave it to its record
    converted = PARAMETERS_BY_NAME[name].convert(value)
    with pytest.raises(ValueError, match=f"--{name}"):
        RECORDS[owner](**{FIELDS.get(name, name): converted})


@pytest.mark.parametrize("name", [name for name in NOT_WITH_TRANSFORMERS
                                  if CHECKED_BY_RECORDS.get(name) in ENGINE_RECORDS])
def test_the_record_that_owns_a_value_refuses_it_with_the_transformers_engine_once(name):
    value = PARAMETERS_BY_NAME[name].example
    with pytest.raises(ConfigError) as excinfo:
        settings(engine="transformers", **{name: value})
    assert str(excinfo.value).count(f"--{name} does not go with --engine=transformers") == 1


def test_a_scheduling_policy_of_ones_own_is_taken_where_no_priority_is_sent():
    assert settings(vllm_args="--scheduling-policy fcfs", prioritize_short_prompts="false").engine.server \
        .extra_args[-2:] == ("--scheduling-policy", "fcfs")
    assert settings(vllm_args="--scheduling-policy priority").engine.priority_scheduling
    settings(vllm_args="--scheduling-policy fcfs", server_url="http://127.0.0.1:8000")  # its policy is its own


def test_the_last_scheduling_policy_in_vllm_args_is_the_one_checked_as_vllm_takes_it():
    assert settings(vllm_args="--scheduling-policy fcfs --scheduling-policy priority").engine.priority_scheduling
    with pytest.raises(ConfigError, match="--scheduling-policy fcfs"):
        settings(vllm_args="--scheduling-policy=priority --scheduling_policy=fcfs")
