"""The hourly ceiling make run prints before a launch (ops/cost.py), priced from a stand-in of the Cloud Billing
Catalog API that answers as its documentation shows (tests/billing_catalog_stand_in.py: paged services and SKUs,
several regions and GPUs, Google's errors), with the machine type's shape from Compute Engine through the real gcloud.
The launch itself goes through the real gcloud to the recorder (tests/gcloud_recorder.py), as in tests/test_deploy.py,
so what is asserted is whether Dataflow would have been asked to launch."""

from __future__ import annotations

import dataclasses
import os
import re
import select
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import pytest

from ops import cost
from tests.billing_catalog_stand_in import CatalogStandIn
from tests.conftest import DEPLOY_TAG as TAG
from tests.gcloud_recorder import Recorder

REPO = Path(__file__).resolve().parent.parent
# The default job: .env.example's machine, GPU and workers, the template's 200 GB disk.
DEFAULT_JOB = cost.Job(project="proj-123456", region="us-central1", zone="", machine_type="g2-standard-8",
                       gpu_type="nvidia-l4", gpu_count=1, disk_gb=200, max_workers=4,
                       launcher_machine_type="e2-standard-4")


@pytest.fixture
def catalog():
    stand_in = CatalogStandIn()
    yield stand_in
    stand_in.close()


@pytest.fixture
def gcloud_env(tmp_path, catalog, monkeypatch):
    """gcloud (Compute Engine) and the catalog pointed at the stand-in, with no credentials (gcloud's own setting)."""
    env = {"CLOUDSDK_CONFIG": str(tmp_path / "gcloud-config"), "CLOUDSDK_AUTH_DISABLE_CREDENTIALS": "true",
           "CLOUDSDK_CORE_DISABLE_PROMPTS": "1", "CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK": "true",
           **catalog.env()}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # What these tests price must not hang on how busy the machine is: a fresh gcloud took over 15 s a call on a
    # loaded 2-core CI runner. The deadline itself is tested with its own, shorter value.
    monkeypatch.setattr(cost, "DEADLINE_S", 180.0)
    return env


def make_run(recorder: Recorder, catalog: CatalogStandIn | None, env_file: Path, stdin=subprocess.DEVNULL,
             **variables: str) -> subprocess.CompletedProcess:
    """`make run` as tests/test_deploy.py runs it, with the catalog and Compute Engine answered by the stand-in."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("CLOUDSDK_")}
    env.update(recorder.env())
    if catalog:
        env.update(catalog.env())
    args = ["make", "--no-print-directory", "run", f"TAG={TAG}", f"ENV_FILE={env_file}",
            *[f"{key}={value}" for key, value in variables.items()]]
    return subprocess.run(args, cwd=REPO, env=env, stdin=stdin, capture_output=True, text=True, timeout=600)


def launched(recorder: Recorder) -> int:
    return len(recorder.find("POST", r"/flexTemplates:launch$"))


def test_a_sku_is_priced_from_its_latest_pricing_and_dearest_tier():
    """``pricingInfo`` is a timeline in chronological order (the last entry is today's); ``unitPrice`` is Money,
    units + nanos; of tiered rates the ceiling takes the dearest."""
    sku = cost.Sku.from_api({
        "description": "vCPU Time Streaming Iowa", "serviceRegions": ["us-central1"],
        "category": {"resourceFamily": "Compute", "resourceGroup": "CPU", "usageType": "OnDemand"},
        "pricingInfo": [
            {"pricingExpression": {"usageUnit": "h", "tieredRates": [
                {"startUsageAmount": 0, "unitPrice": {"currencyCode": "USD", "units": "9", "nanos": 0}}]}},
            {"pricingExpression": {"usageUnit": "h", "tieredRates": [
                {"startUsageAmount": 0, "unitPrice": {"currencyCode": "USD", "units": "0", "nanos": 0}},
                {"startUsageAmount": 10, "unitPrice": {"currencyCode": "USD", "units": "1", "nanos": 250000000}}]}}]})
    assert sku is not None and sku.unit_price == Decimal("1.25") and sku.per_hour() == Decimal("1.25")
    monthly = cost.Sku("PD", "", "OnDemand", ("r",), "GiBy.mo", Decimal("0.0438"), "USD")
    assert monthly.per_hour() == Decimal("0.00006")
    assert cost.Sku("x", "", "OnDemand", ("r",), "By", Decimal(1), "USD").per_hour() is None
    assert cost.Sku.from_api({"description": "no price", "pricingInfo": []}) is None


def test_the_default_jobs_ceiling_is_four_workers_at_the_catalogs_us_central1_prices(catalog, gcloud_env):
    """g2-standard-8 (8 vCPUs, 32 GiB from Compute Engine) with one L4 and a 200 GB disk, MAX_WORKERS=4: each
    resource at the streaming worker's on-demand SKU for us-central1, none from batch, committed-use, preemptible, SSD
    or another region's SKUs, all pages of both lists read, and Dataflow found by its display name."""
    ceiling = cost.job_ceiling(DEFAULT_JOB, gcloud_env)
    assert isinstance(ceiling, cost.Ceiling), ceiling
    assert [(line.what, line.quantity, line.unit_price, line.sku) for line in ceiling.lines] == [
        ("8 vCPUs", 8, Decimal("0.069"), "vCPU Time Streaming Iowa"),
        ("32 GiB memory", 32, Decimal("0.003557"), "RAM Time Streaming Iowa"),
        ("1 nvidia-l4", 1, Decimal("0.56"), "Nvidia L4 GPU Iowa"),
        ("200 GB boot disk", 200, Decimal("0.000054"), "Local Disk Time PD Standard Iowa")]
    # 8 × 0.069 + 32 × 0.003557 + 0.56 + 200 × 0.000054 = 1.236624 a worker-hour; four of them.
    assert ceiling.per_worker == Decimal("1.236624") and ceiling.per_hour == Decimal("4.946496")
    assert ceiling.currency == "USD"
    pages = [request for request in catalog.requests if "pageToken=" in request]
    assert any("/v1/services?" in request for request in pages), catalog.requests  # Dataflow is on page 2
    assert sum("/skus?" in request for request in pages) >= 2, catalog.requests
    # us-central1-a does not offer the machine type in the stand-in: the next zone of the region answers.
    assert [r for r in catalog.requests if "machineTypes" in r] == [
        f"GET /compute/v1/projects/proj-123456/zones/us-central1-{zone}/machineTypes/g2-standard-8?alt=json"
        for zone in "ab"]
    report = "\n".join(cost.report(ceiling, DEFAULT_JOB))
    assert "at most 4.9465 USD an hour" in report and "one worker: 1.2366 USD" in report
    assert "Streaming Engine" in report and "launcher VM (e2-standard-4" in report


def test_the_ceiling_agrees_with_the_worked_example_in_the_docs(catalog, gcloud_env):
    """operations.md's worked example is this sum for one worker: its rows are the ceiling's lines."""
    section = (REPO / "docs" / "operations.md").read_text().split('<a id="idle-worker-cost"></a>', 1)[1]
    rows = re.findall(r"^\| [^|*]+? \| (\d+) \| ([\d.]+) per [^|]+ \| ([\d.]+) \|$", section, re.MULTILINE)
    ceiling = cost.job_ceiling(DEFAULT_JOB, gcloud_env)
    assert isinstance(ceiling, cost.Ceiling), ceiling
    assert [(Decimal(q), Decimal(p)) for q, p, _ in rows] == [
        (line.quantity, line.unit_price) for line in ceiling.lines]


@pytest.mark.parametrize("job, price", [
    (DEFAULT_JOB, Decimal("0.56")),  # us-central1's L4, not its preemptible one
    (cost.Job("proj-123456", "europe-west4", "europe-west4-b", "g2-standard-8", "nvidia-l4", 1, 200, 1, ""),
     Decimal("0.616")),  # the Netherlands' price, and the zone asked for
    (cost.Job("proj-123456", "us-central1", "", "a2-ultragpu-1g", "nvidia-a100-80gb", 1, 200, 1, ""),
     Decimal("3.93")),  # A100 80GB, not the 40GB A100
    (cost.Job("proj-123456", "us-central1", "", "a2-ultragpu-1g", "nvidia-tesla-a100", 1, 200, 1, ""),
     Decimal("2.48")),
    (cost.Job("proj-123456", "asia-northeast1", "", "n1-standard-8", "nvidia-tesla-t4", 2, 100, 3, ""),
     Decimal("0.4375")),
])
def test_the_gpu_is_priced_by_its_type_in_the_jobs_region(catalog, gcloud_env, job, price):
    ceiling = cost.job_ceiling(job, gcloud_env)
    assert isinstance(ceiling, cost.Ceiling), ceiling
    gpu = next(line for line in ceiling.lines if job.gpu_type in line.what)
    assert (gpu.quantity, gpu.unit_price) == (job.gpu_count, price)
    assert ceiling.per_hour == ceiling.per_worker * job.max_workers
    if job.zone:
        assert [r for r in catalog.requests if "compute" in r] == [
            f"GET /compute/v1/projects/proj-123456/zones/{job.zone}/machineTypes/{job.machine_type}?alt=json"]


@pytest.mark.parametrize("change, reason", [
    ({"region": "asia-northeast1"}, "no on-demand Dataflow SKU for nvidia-l4 GPUs in asia-northeast1"),
    ({"region": "southamerica-east1"}, "Compute Engine did not describe region southamerica-east1"),
    ({"machine_type": "g2-standard-4"}, "Compute Engine did not describe machine type g2-standard-4 in us-central1"),
    ({"gpu_type": "nvidia-tesla-k80"}, "no catalog name is known for GPU_TYPE=nvidia-tesla-k80"),
])
def test_what_the_catalog_or_compute_engine_lack_makes_the_ceiling_unknown(catalog, gcloud_env, change, reason):
    found = cost.job_ceiling(dataclasses.replace(DEFAULT_JOB, **change), gcloud_env)
    assert isinstance(found, cost.Unknown) and reason in found.reason, found


@pytest.mark.parametrize("deny, reason", [
    ("PERMISSION_DENIED", "PERMISSION_DENIED: Method doesn't allow unregistered callers"),
    ("SERVICE_DISABLED", "PERMISSION_DENIED (SERVICE_DISABLED): Cloud Billing API has not been used"),
])
def test_a_catalog_that_refuses_gives_its_reason(catalog, gcloud_env, deny, reason):
    catalog.deny = deny
    found = cost.job_ceiling(DEFAULT_JOB, gcloud_env)
    assert isinstance(found, cost.Unknown) and reason in found.reason, found
    if deny == "SERVICE_DISABLED":
        assert "gcloud services enable cloudbilling.googleapis.com" in found.reason


def test_no_catalog_no_credentials_and_a_silent_catalog_fail_fast(tmp_path, catalog):
    """Without the override and with gcloud's no-credentials setting (the deploy tests' setting) nothing is asked;
    without any credentials (no ADC, no metadata server) the lookup says so within seconds; a catalog that does not
    answer at all is given up at the deadline."""
    started = time.monotonic()
    found = cost.job_ceiling(DEFAULT_JOB, {"CLOUDSDK_AUTH_DISABLE_CREDENTIALS": "true"})
    assert isinstance(found, cost.Unknown) and "CLOUDSDK_AUTH_DISABLE_CREDENTIALS" in found.reason
    assert time.monotonic() - started < 1
    # A process of its own: google-auth reads where to look for credentials from its environment at import.
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("CLOUDSDK_", "GOOGLE_", "GCE_"))}
    env.update({"CLOUDSDK_CONFIG": str(tmp_path / "empty"), "GCE_METADATA_HOST": "127.0.0.1:9",
                "GCE_METADATA_IP": "127.0.0.1:9", "CLOUDSDK_API_ENDPOINT_OVERRIDES_CLOUDBILLING": catalog.url,
                "CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE": catalog.url, "CLOUDSDK_AUTH_DISABLE_CREDENTIALS": "",
                "CLOUDSDK_CORE_DISABLE_PROMPTS": "1", "HOME": str(tmp_path)})
    code = ("import os, time; from ops import cost; from tests.test_cost import DEFAULT_JOB; t = time.monotonic(); "
            "found = cost.job_ceiling(DEFAULT_JOB, os.environ); print(round(time.monotonic() - t, 1), found)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert "no Application Default Credentials" in result.stdout, result.stdout + result.stderr
    assert float(result.stdout.split()[0]) < 10, result.stdout
    assert not [r for r in catalog.requests if r.startswith("GET /v1/")]  # nothing was asked without credentials


def test_a_catalog_that_never_answers_is_given_up_at_the_deadline(catalog, gcloud_env, monkeypatch):
    monkeypatch.setattr(cost, "DEADLINE_S", 1.0)
    monkeypatch.setattr(cost, "dataflow_skus", lambda http, root: time.sleep(5))
    started = time.monotonic()
    found = cost.job_ceiling(DEFAULT_JOB, gcloud_env)
    assert isinstance(found, cost.Unknown) and "did not answer within 1 s" in found.reason, found
    assert time.monotonic() - started < 3


def test_the_settings_are_checked_by_name():
    assert cost.parse_limit("") is None and cost.parse_limit("7.5") == Decimal("7.5")
    for bad in ("abc", "-1", "0", "nan", "inf"):
        with pytest.raises(cost.DeployError, match="MAX_HOURLY_COST"):
            cost.parse_limit(bad)
    assert cost.parse_confirm("1") and cost.parse_confirm("yes") and not cost.parse_confirm("")
    with pytest.raises(cost.DeployError, match="CONFIRM_COST"):
        cost.parse_confirm("maybe")


def test_make_run_prints_the_ceiling_and_launches(recorder, catalog, env_file):
    result = make_run(recorder, catalog, env_file)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "The job's hourly ceiling in us-central1" in result.stdout
    assert "MAX_WORKERS=4: at most 4.9465 USD an hour" in result.stdout
    assert launched(recorder) == 1
    # The ceiling is printed before the launch command runs.
    assert result.stdout.index("hourly ceiling") < result.stdout.index("gcloud dataflow flex-template run")


def test_a_region_without_the_gpu_in_the_catalog_launches_with_the_ceiling_unknown(recorder, catalog, env_file):
    result = make_run(recorder, catalog, env_file, REGION="asia-northeast1", MAX_HOURLY_COST="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("The job's hourly ceiling is unknown: no on-demand Dataflow SKU for nvidia-l4 GPUs in asia-northeast1"
            in result.stdout)
    assert "MAX_HOURLY_COST=1 is not checked" in result.stdout
    assert launched(recorder) == 1


def test_an_unreadable_catalog_says_why_and_launches(recorder, catalog, env_file):
    catalog.deny = "PERMISSION_DENIED"
    result = make_run(recorder, catalog, env_file, MAX_HOURLY_COST="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ceiling is unknown: the catalog answered PERMISSION_DENIED: Method doesn't allow" in result.stdout
    assert launched(recorder) == 1


def test_above_max_hourly_cost_without_a_terminal_refuses_before_anything_launches(recorder, catalog, env_file):
    refused = make_run(recorder, catalog, env_file, MAX_HOURLY_COST="4.50")
    assert refused.returncode != 0, refused.stdout + refused.stderr
    assert "above MAX_HOURLY_COST=4.50" in refused.stderr and "no terminal to confirm it" in refused.stderr
    assert "raise MAX_HOURLY_COST" in refused.stderr and "CONFIRM_COST=1" in refused.stderr
    assert launched(recorder) == 0 and "flex-template run" not in refused.stdout
    dry = make_run(recorder, catalog, env_file, MAX_HOURLY_COST="4.50", DRY_RUN="1")
    assert dry.returncode == 0 and "make run asks before launching" in dry.stdout, dry.stdout + dry.stderr
    assert launched(recorder) == 0
    under = make_run(recorder, catalog, env_file, MAX_HOURLY_COST="5")
    assert under.returncode == 0 and launched(recorder) == 1, under.stdout + under.stderr
    confirmed = make_run(recorder, catalog, env_file, MAX_HOURLY_COST="4.50", CONFIRM_COST="1")
    assert confirmed.returncode == 0, confirmed.stdout + confirmed.stderr
    assert "CONFIRM_COST=1 launches it anyway" in confirmed.stdout and launched(recorder) == 2


def run_on_a_terminal(recorder: Recorder, catalog: CatalogStandIn, env_file: Path, answer: str) -> tuple[int, str]:
    """make run with a terminal for stdin: the answer is typed once the question is asked."""
    import pty

    env = {key: value for key, value in os.environ.items() if not key.startswith("CLOUDSDK_")}
    env.update({**recorder.env(), **catalog.env()})
    controller, terminal = pty.openpty()
    process = subprocess.Popen(["make", "--no-print-directory", "run", f"TAG={TAG}", f"ENV_FILE={env_file}",
                                "MAX_HOURLY_COST=2"], cwd=REPO, env=env, stdin=terminal, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    os.close(terminal)
    assert process.stdout is not None
    seen = b""
    deadline = time.monotonic() + 300
    while b"[y/N]" not in seen and time.monotonic() < deadline and process.poll() is None:
        if select.select([process.stdout], [], [], 1)[0]:
            seen += os.read(process.stdout.fileno(), 4096)
    os.write(controller, answer.encode() + b"\n")
    rest, _ = process.communicate(timeout=300)
    os.close(controller)
    return process.returncode, (seen + rest).decode()


def test_above_max_hourly_cost_on_a_terminal_asks(recorder, catalog, env_file):
    code, output = run_on_a_terminal(recorder, catalog, env_file, "n")
    assert "Launch anyway? [y/N]" in output and code != 0, output
    assert "the launch was not confirmed" in output and launched(recorder) == 0
    code, output = run_on_a_terminal(recorder, catalog, env_file, "y")
    assert code == 0 and launched(recorder) == 1, output


def test_a_machine_type_that_brings_its_gpu_is_priced_with_it_without_gpu_type(recorder, catalog, env_file):
    """g2-standard-8 comes with one L4 whatever GPU_TYPE says: leaving GPU_TYPE empty must not drop the GPU from
    the ceiling (a ceiling too low is worse than none)."""
    result = make_run(recorder, catalog, env_file, GPU_TYPE="")
    assert "MAX_WORKERS=4: at most 4.9465 USD an hour" in result.stdout, result.stdout + result.stderr
