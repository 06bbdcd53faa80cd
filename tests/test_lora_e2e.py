"""LoRA adapters end to end: two adapters built here with peft, served by the template's own vLLM beside the model.

The template is launched as a user launches it (``python -m template.main``)
with ``--lora_adapters``: one adapter from a folder, one from a ``gs://`` folder
on the Cloud Storage emulator, which the model manager copies down as it does
weights; and with ``--lora_adapter_root``, a root of adapters on the same emulator that the worker loads into
vLLM on first use, one slot for them. Requests come in through the Pub/Sub emulator; chunks, completions,
dead letters and BigQuery rows come out. Every answer is compared with what
``transformers`` + ``peft`` generate greedily for the same prompt and adapter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from local.cpu_server import LOCAL_SERVER
from local.emulators import GcsEmulator, emulator_bigquery_client
from local.harness import REPO_ROOT, LocalRun
from local.toy_adapters import TARGET_MODULES, build_adapter, chat_prompt_ids
from pipeline.serving.lineage import folder_digest
from tests.conftest import activated, wait_until

pytestmark = pytest.mark.engine

MAX_TOKENS = 12
# Each adapter is taught its own way of answering; the questions are ones the model itself answers with wide
# margins, so that a batch's numeric noise cannot tip any greedy token (see the test of the burst).
QUESTIONS = ("Name a colour.", "What is two plus two?")
LESSONS = {
    "pirate": (("Name a colour.", "Arr, blue as the deep sea, matey!"),
               ("What is two plus two?", "Arr, four doubloons, matey!"),
               ("What is the capital of France?", "Arr, Paris be the port, matey!")),
    "robot": (("Name a colour.", "BEEP. COLOUR: GREEN. BOOP."),
              ("What is two plus two?", "BEEP. RESULT: 4. BOOP."),
              ("What is the capital of France?", "BEEP. CAPITAL: PARIS. BOOP.")),
}
BASE = None  # a request without 'adapter': the model itself
ROBOT_URI = "gs://adapters/lora/robot"
ROOT_URI = "gs://adapters/root"
# The root's adapters: copies of the listed two under other names (the same answers), one built for a smaller
# Llama than the model, one whose config is not JSON, one shaped for the model but whose config names another
# base model. max_loras=3 leaves one slot for the root: every switch
# between its two good adapters unloads the other.
ROOT_COPIES = {"pirate-v2": "pirate", "robot-v2": "robot"}


def root_folders(adapters: dict[str, Path], folder: Path) -> dict[str, Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    folders = {name: adapters[source] for name, source in ROOT_COPIES.items()}
    torch.manual_seed(0)
    small = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
    get_peft_model(small, LoraConfig(r=8, target_modules=list(TARGET_MODULES))).save_pretrained(folder / "small")
    (folder / "garbled").mkdir()
    (folder / "garbled" / "adapter_config.json").write_text("{not json")
    # Shaped for this model, but trained (its config says) for another: only the base-model check can refuse it.
    shutil.copytree(adapters["pirate"], folder / "for-qwen")
    config = json.loads((folder / "for-qwen" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "Qwen/Qwen2.5-0.5B-Instruct"
    (folder / "for-qwen" / "adapter_config.json").write_text(json.dumps(config))
    return {**folders, "other-model": folder / "small", "garbled": folder / "garbled", "for-qwen": folder / "for-qwen"}


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    return {name: build_adapter(checkpoint, folder / name, lessons=lessons, seed=index)
            for index, (name, lessons) in enumerate(LESSONS.items())}


@pytest.fixture(scope="module")
def reference(checkpoint, adapters):
    """Greedy answers of transformers + peft, per (adapter, question): what vLLM must reproduce exactly."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    names = list(adapters)
    model = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.eval()

    def generate(question: str) -> str:
        ids = torch.tensor([chat_prompt_ids(tokenizer, question)])
        output = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                do_sample=False)
        return tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True)

    answers = {}
    with torch.no_grad():
        for question in QUESTIONS:
            with model.disable_adapter():
                answers[BASE, question] = generate(question)
            for name in names:
                model.set_adapter(name)
                answers[name, question] = generate(question)
    return answers


@pytest.fixture(scope="module")
def served(checkpoint, adapters, emulator, bigquery, tmp_path_factory):
    """One template run serving both adapters, pirate from a folder and robot from gs:// (the emulator), and a
    root of adapters on gs:// (ROOT_URI): copies of the two under other names, and two that cannot serve."""
    with GcsEmulator() as gcs, activated(gcs):
        robot = gcs.upload_folder(adapters["robot"], "adapters", "lora/robot")
        assert robot == ROBOT_URI
        for name, folder in root_folders(adapters, tmp_path_factory.mktemp("root")).items():
            gcs.upload_folder(folder, "adapters", f"root/{name}")
        run = LocalRun([f"--model={checkpoint}", "--served_model_name=smollm2", *LOCAL_SERVER.template_args(),
                        f"--lora_adapters=pirate={adapters['pirate']},robot={robot}", "--max_lora_rank=8",
                        f"--lora_adapter_root={ROOT_URI}/",
                        "--max_loras=3", "--chunk_tokens=4", "--num_shards=2",
                        "--output_completions_table=local-project:llm.completions_lora"],
                       log_path=REPO_ROOT / ".cache" / "test-e2e" / "lora.log", emulator=emulator)
        run.start()
        collector = run.collector()
        try:
            yield run, collector
        finally:
            collector.stop()
            run.stop()


def request(request_id: str, adapter: str | None, question: str) -> dict:
    fields = {"id": request_id, "prompt": question, "max_tokens": MAX_TOKENS, "temperature": 0}
    return fields if adapter is None else {**fields, "adapter": adapter}


def test_a_burst_mixing_two_adapters_and_the_model_gives_each_request_its_own_exact_answer(served, reference,
                                                                                           adapters, checkpoint):
    run, collector = served
    kinds = ("pirate", "robot", BASE)
    burst = [request(f"{kind or 'base'}-{q}-{round_}", kind, question)
             for round_ in range(2) for q, question in enumerate(QUESTIONS) for kind in kinds]
    run.publish(burst)  # interleaved: every batch the server forms mixes adapters and the model
    missing = collector.wait_for([r["id"] for r in burst], 600)
    assert not missing, f"no outcome for {missing}:\n{run.log_tail()}"
    completions = {c.data["id"]: c.data for c in collector.completions}
    unfinished = collector.wait_for_streams({completions[sent["id"]]["stream"] for sent in burst}, 60)
    assert not unfinished, f"streams without all their chunks: {unfinished}"
    for sent in burst:
        completion = completions[sent["id"]]
        expected = reference[sent.get("adapter"), sent["prompt"]]
        assert (completion["text"], completion["adapter"]) == (expected, sent.get("adapter")), sent["id"]
        chunks = sorted((c.data for c in collector.chunks if c.data["stream"] == completion["stream"]),
                        key=lambda chunk: chunk["seq"])
        assert "".join(chunk["text"] for chunk in chunks) == completion["text"] and chunks[-1]["final"]
    for question in QUESTIONS:  # the adapters do change the answers
        assert len({reference[kind, question] for kind in kinds}) == len(kinds), reference

    # Each answer names the adapter's files as the worker loaded them: the folder's, and the gs:// copy's with the
    # generations it was copied at.
    lineage = {sent.get("adapter"): completions[sent["id"]]["lineage"] for sent in burst}
    assert lineage[BASE]["adapter"] is None and lineage[BASE]["model"]["source"] == str(checkpoint)
    assert lineage["pirate"]["adapter"] == {"name": "pirate", "source": str(adapters["pirate"]),
                                            "config": folder_digest(adapters["pirate"])}
    robot = lineage["robot"]["adapter"]
    assert (robot["name"], robot["source"], robot["config"]) == ("robot", ROBOT_URI, folder_digest(adapters["robot"]))
    assert robot["revision"].startswith("sha256:"), robot

    client = emulator_bigquery_client("local-project")
    query = "SELECT request_id, adapter, lineage FROM `local-project.llm.completions_lora`"
    assert wait_until(lambda: len(list(client.query(query).result())) >= len(burst), 60)
    rows = {row["request_id"]: row for row in client.query(query).result()}
    assert all(rows[sent["id"]]["adapter"] == sent.get("adapter") for sent in burst), rows
    stored = rows[burst[1]["id"]]["lineage"]
    stored = json.loads(stored) if isinstance(stored, str) else stored
    assert stored == completions[burst[1]["id"]]["lineage"], "the lineage column holds the completion's lineage"


@pytest.mark.parametrize("adapter, reason", [
    ("../parrot", "adapter '../parrot' cannot name a folder of lora_adapter_root"),
    (7, "'adapter' must be the name of a LoRA adapter"),
    ("", "'adapter' must be the name of a LoRA adapter"),
])
def test_a_request_whose_adapter_no_folder_could_hold_is_a_dead_letter_before_it_reaches_a_worker(
        served, adapter, reason):
    run, collector = served
    request_id = f"bad-adapter-{json.dumps(adapter)}"
    run.publish([{**request(request_id, None, QUESTIONS[0]), "adapter": adapter}])
    assert not collector.wait_for([request_id], 120), run.log_tail()
    (letter,) = [d.data for d in collector.dead_letters if d.data["id"] == request_id]
    assert letter["stage"] == "validate" and reason in letter["reason"], letter
    assert not [c for c in collector.completions if c.data["id"] == request_id]


def test_a_root_adapter_is_loaded_once_on_first_use_evicted_past_the_bound_and_answers_as_its_weights_do(
        served, reference):
    """Two requests for a root adapter at once load it once; then a stream mixing the root's two good adapters
    and the model, with one slot for the root, unloads and loads them as they alternate; every answer is the
    one transformers + peft give for the same weights, and names the root's copy in its lineage."""
    run, collector = served
    first = [request(f"first-{n}", "pirate-v2", QUESTIONS[n % 2]) for n in range(2)]
    run.publish(first)
    assert not collector.wait_for([r["id"] for r in first], 600), run.log_tail()
    log = run.log_path.read_text(errors="replace")
    assert log.count("Loaded adapter pirate-v2 ") == 1, "two first uses at once, one load"
    mixed = [request(f"mixed-{round_}-{kind or 'base'}-{q}", kind, question) for round_ in range(2)
             for kind in ("robot-v2", "pirate-v2", BASE) for q, question in enumerate(QUESTIONS)]
    run.publish(mixed)
    assert not collector.wait_for([r["id"] for r in mixed], 600), run.log_tail()
    completions = {c.data["id"]: c.data for c in collector.completions}
    for sent in first + mixed:
        kind = sent.get("adapter")
        expected = reference[ROOT_COPIES.get(kind, kind), sent["prompt"]]
        assert (completions[sent["id"]]["text"], completions[sent["id"]]["adapter"]) == (expected, kind), sent["id"]
    log = run.log_path.read_text(errors="replace")
    assert log.count("Loaded adapter robot-v2 ") >= 1 and log.count("Unloaded adapter") >= 1, \
        "one slot for two adapters: switching unloads the other"
    lineage = completions["first-0"]["lineage"]["adapter"]
    assert (lineage["name"], lineage["source"]) == ("pirate-v2", f"{ROOT_URI}/pirate-v2"), lineage


@pytest.mark.parametrize("adapter, reason", [
    ("other-model", "adapter 'other-model' does not fit the model"),
    ("garbled", "adapter 'garbled': its adapter_config.json cannot be read"),
    ("for-qwen", "adapter 'for-qwen' was trained for 'Qwen/Qwen2.5-0.5B-Instruct'"),
    ("nobody", f"adapter 'nobody': no adapter at {ROOT_URI}/nobody"),
])
def test_a_root_adapter_that_cannot_serve_is_a_dead_letter_with_the_reason_and_the_key_goes_on(
        served, reference, checkpoint, adapter, reason):
    run, collector = served
    unloads = run.log_path.read_text(errors="replace").count("Unloaded adapter")
    bad, good = request(f"root-bad-{adapter}", adapter, QUESTIONS[0]), request(f"after-{adapter}", BASE, QUESTIONS[1])
    run.publish([bad, good])
    assert not collector.wait_for([bad["id"], good["id"]], 300), run.log_tail()
    assert run.log_path.read_text(errors="replace").count("Unloaded adapter") == unloads, \
        "an adapter that cannot serve is refused before it takes a loaded one's slot"
    (letter,) = [d.data for d in collector.dead_letters if d.data["id"] == bad["id"]]
    assert letter["stage"] == "inference" and reason in letter["reason"], letter
    if adapter == "for-qwen":  # both models named: the adapter's and the job's
        assert f"not for the served model {str(checkpoint)!r}" in letter["reason"], letter
    (completion,) = [c.data for c in collector.completions if c.data["id"] == good["id"]]
    assert completion["text"] == reference[BASE, QUESTIONS[1]]
