"""Fine-tuning over gRPC as LocalAI's fine-tuning service drives it: LoadModel with
the backend's own name, StartFineTune (LoRA SFT on a tiny llama and a dataset of
one made-up fact), FineTuneProgress in order with its statuses, ListCheckpoints,
StopFineTune and a resume that goes on counting, a killed backend (whole checkpoints
left, the training process gone), the trained adapter served through
LoraAdapters, and ExportModel's lora, merged_16bit and merged_4bit folders serving
what was trained; DPO and ORPO on pairs; the embedded model trained and exported
as GGUF; bad requests get statuses naming the field."""

import json
import math
import os
import time
from pathlib import Path

import grpc
import jinja2
import mlx.core as mx
import pytest

import backend_pb2 as pb
from tests.support import Server, error_of
from tests.tiny_models import make_tiny_draft

FACT = "The capital of Zarnovia is Quillhaven."
QUESTION = "The capital of Zarnovia is"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # Wide enough to learn a sentence in 30 LoRA steps (width 32 does not).
    return make_tiny_draft(
        tmp_path_factory.mktemp("base") / "llama", layers=2, width=128
    )


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dataset")
    lines = [json.dumps({"text": FACT}) for _ in range(16)]
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "valid.jsonl").write_text("\n".join(lines[:4]) + "\n")
    return folder


@pytest.fixture(scope="module")
def trainer():
    srv = Server()
    result = srv.stub.LoadModel(pb.ModelOptions(Model="mlx"))
    assert result.success and "ready to fine-tune" in result.message
    yield srv
    srv.stop()


def fine_tune(tiny, dataset, output, **fields) -> pb.FineTuneRequest:
    settings = dict(
        model=str(tiny),
        training_type="lora",
        training_method="sft",
        adapter_rank=8,
        adapter_alpha=160,
        # 1e-3 is unstable on some CPUs: a 2-core Xeon with MKL ended 30 steps
        # at half the first loss or above, the fact unlearnt.
        learning_rate=4e-4,
        batch_size=4,
        max_steps=30,
        save_steps=10,
        dataset_source=str(dataset),
        output_dir=str(output),
    )
    return pb.FineTuneRequest(**{**settings, **fields})


def progress(stub, job_id: str) -> list:
    request = pb.FineTuneProgressRequest(job_id=job_id)
    return list(stub.FineTuneProgress(request, timeout=600))


def greedy(stub, tokens: int = 8) -> str:
    request = pb.PredictOptions(Prompt=QUESTION, Tokens=tokens, Temperature=0)
    return stub.Predict(request).message.decode()


@pytest.fixture(scope="module")
def job_a(trainer, tiny, dataset, tmp_path_factory):
    """Job "a": 30 steps, a checkpoint every 10; its folder and its updates."""
    output = tmp_path_factory.mktemp("trained") / "job"
    started = trainer.stub.StartFineTune(fine_tune(tiny, dataset, output, job_id="a"))
    assert started.success and started.job_id == "a"
    return output, progress(trainer.stub, "a")


@pytest.fixture(scope="module")
def trained(job_a):
    output, updates = job_a
    assert updates[-1].status == "completed"
    return output / "checkpoint-30"


def test_lora_sft_trains_saves_and_serves(trainer, tiny, job_a):
    output, updates = job_a
    statuses = [u.status for u in updates]
    assert statuses[:5] == [
        "queued",
        "loading_model",
        "loading_dataset",
        "loading_dataset",
        "training",
    ]
    # Once the dataset is read, the job's memory estimate, which serving counts.
    assert updates[3].extra_metrics["estimated_memory_gb"] > 0
    assert statuses[-1] == "completed", updates[-1].message
    training = [u for u in updates if u.status == "training"]
    assert [u.current_step for u in training] == list(range(1, 31))
    assert all(u.total_steps == 30 for u in training)
    assert training[-1].loss < training[0].loss / 2
    assert training[-1].current_epoch == pytest.approx(30 * 4 / 16)
    assert training[-1].progress_percent == pytest.approx(100.0)
    # The job's memory by its estimate, which serving's budget counts while it runs.
    assert 0 < training[0].extra_metrics["estimated_memory_gb"] < 8
    saved = [u.checkpoint_path for u in updates if u.status == "saving"]
    assert saved == [str(output / f"checkpoint-{s}") for s in (10, 20, 30)]
    listed = trainer.stub.ListCheckpoints(
        pb.ListCheckpointsRequest(output_dir=str(output))
    ).checkpoints
    assert [(c.path, c.step) for c in listed] == [
        (p, s) for p, s in zip(saved, (10, 20, 30))
    ]
    assert listed[-1].loss == pytest.approx(training[-1].loss, rel=1e-5)

    # The adapter changes what the base model says: it has learned the fact.
    assert trainer.stub.LoadModel(pb.ModelOptions(Model=str(tiny))).success
    before = greedy(trainer.stub)
    adapted = pb.ModelOptions(Model=str(tiny), LoraAdapters=[str(output)])
    assert trainer.stub.LoadModel(adapted).success
    after = greedy(trainer.stub)
    assert after.strip().startswith("Quillhaven") and not before.strip().startswith(
        "Quillhaven"
    )


def test_a_stopped_job_resumes_where_it_stopped(trainer, tiny, dataset, tmp_path):
    output = tmp_path / "job"
    request = fine_tune(tiny, dataset, output, job_id="b", max_steps=400)
    trainer.stub.StartFineTune(request)
    stream = trainer.stub.FineTuneProgress(pb.FineTuneProgressRequest(job_id="b"))
    updates = []
    for update in stream:
        updates.append(update)
        if update.status == "training" and update.current_step == 5:
            stop = pb.FineTuneStopRequest(job_id="b", save_checkpoint=True)
            assert trainer.stub.StopFineTune(stop).success
    assert updates[-1].status == "stopped"
    stopped = updates[-1].current_step
    saved = [u for u in updates if u.status == "saving"][-1]
    assert saved.current_step == stopped and 5 <= stopped < 400

    resumed = fine_tune(
        tiny,
        dataset,
        output,
        job_id="c",
        max_steps=stopped + 3,
        resume_from_checkpoint=saved.checkpoint_path,
    )
    trainer.stub.StartFineTune(resumed)
    steps = [
        u.current_step for u in progress(trainer.stub, "c") if u.status == "training"
    ]
    assert steps == [stopped + 1, stopped + 2, stopped + 3]


@pytest.mark.parametrize(
    "fields, code, field",
    [
        (dict(training_type="loha"), grpc.StatusCode.UNIMPLEMENTED, "training_type"),
        (
            dict(training_method="grpo"),
            grpc.StatusCode.UNIMPLEMENTED,
            "training_method",
        ),
        (
            dict(dataset_source="/nowhere"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "dataset_source",
        ),
        (dict(output_dir=""), grpc.StatusCode.INVALID_ARGUMENT, "output_dir"),
        (dict(batch_size=-1), grpc.StatusCode.INVALID_ARGUMENT, "batch_size"),
        (
            dict(extra_options={"dora": "maybe"}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "extra_options",
        ),
    ],
)
def test_bad_requests_name_the_field(
    trainer, tiny, dataset, tmp_path, fields, code, field
):
    request = fine_tune(tiny, dataset, tmp_path / "job", **fields)
    error = error_of(trainer.stub.StartFineTune, request)
    assert error.code() == code and error.details().startswith(f"{field}:")


def test_a_malformed_line_is_named_not_quoted(trainer, tiny, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    secret = "sk-do-not-echo"
    lines = [json.dumps({"text": FACT})] * 4 + [f"{{{secret}"]
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    error = error_of(
        trainer.stub.StartFineTune, fine_tune(tiny, folder, tmp_path / "job")
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "dataset_source: line 5 of train.jsonl is not JSON"


def test_progress_of_an_unknown_job_is_not_found(trainer):
    error = error_of(progress, trainer.stub, "nope")
    assert error.code() == grpc.StatusCode.NOT_FOUND


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_a_killed_backend_leaves_whole_checkpoints_and_no_worker(
    tiny, dataset, tmp_path
):
    output = tmp_path / "job"
    srv = Server()
    try:
        request = fine_tune(
            tiny, dataset, output, job_id="k", max_steps=400, save_steps=3
        )
        srv.stub.StartFineTune(request)
        workers = children_of(srv.process.pid)
        assert len(workers) == 1
        stream = srv.stub.FineTuneProgress(pb.FineTuneProgressRequest(job_id="k"))
        next(u for u in stream if u.status == "saving")
        srv.process.kill()
        srv.process.wait()
    finally:
        srv.stop()
    # The worker sees its input close and ends after its step.
    deadline = time.monotonic() + 60
    while Path(f"/proc/{workers[0]}").exists():
        assert time.monotonic() < deadline, "the training process outlived the backend"
        time.sleep(0.1)
    folders = sorted(
        p.name for p in output.iterdir() if p.name.startswith("checkpoint-")
    )
    assert folders and not any(output.glob(".*partial"))
    for name in folders:
        state = json.loads((output / name / "trainer_state.json").read_text())
        assert name == f"checkpoint-{state['step']}" and state["step"] % 3 == 0
        assert (output / name / "adapters.safetensors").stat().st_size > 0


@pytest.mark.parametrize("fmt", ["lora", "merged_16bit", "merged_4bit"])
def test_each_export_serves_what_was_trained(trainer, tiny, trained, tmp_path, fmt):
    out = tmp_path / fmt
    request = pb.ExportModelRequest(
        checkpoint_path=str(trained), output_path=str(out), export_format=fmt
    )
    result = trainer.stub.ExportModel(request, timeout=300)
    assert result.success, result.message
    if fmt == "lora":
        assert sorted(p.name for p in out.iterdir()) == [
            "adapter_config.json",
            "adapters.safetensors",
        ]
        options = pb.ModelOptions(Model=str(tiny), LoraAdapters=[str(out)])
    else:
        config = json.loads((out / "config.json").read_text())
        assert ("quantization" in config) == (fmt == "merged_4bit")
        options = pb.ModelOptions(Model=str(out))
    assert trainer.stub.LoadModel(options).success
    assert greedy(trainer.stub).strip().startswith("Quillhaven")


@pytest.mark.parametrize(
    "fields, code, field",
    [
        (
            dict(export_format="diffusers"),
            grpc.StatusCode.UNIMPLEMENTED,
            "export_format",
        ),
        # mlx-lm's converter would write the tiny llama's byte-level BPE vocabulary
        # as SentencePiece.
        (dict(export_format="gguf"), grpc.StatusCode.UNIMPLEMENTED, "export_format"),
        (
            dict(export_format="gguf", quantization_method="q4_k_m"),
            grpc.StatusCode.UNIMPLEMENTED,
            "quantization_method",
        ),
        (
            dict(checkpoint_path="/nowhere"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "checkpoint_path",
        ),
        (dict(output_path=""), grpc.StatusCode.INVALID_ARGUMENT, "output_path"),
    ],
)
def test_bad_exports_name_the_field(trainer, trained, tmp_path, fields, code, field):
    request = pb.ExportModelRequest(
        **{
            "checkpoint_path": str(trained),
            "output_path": str(tmp_path / "out"),
            "export_format": "lora",
            **fields,
        }
    )
    error = error_of(trainer.stub.ExportModel, request)
    assert error.code() == code and error.details().startswith(f"{field}:")


def test_the_embedded_model_learns_the_fact_and_exports_gguf(
    trainer, dataset, tmp_path
):
    """30 LoRA steps on the embedded SmolLM2 GGUF (trained dequantized on the CPU,
    served quantized), then the fused model written as an F16 GGUF file."""
    output = tmp_path / "job"
    # model "": the embedded model.
    request = fine_tune(
        "", dataset, output, learning_rate=1e-4, batch_size=1, job_id="embedded"
    )
    assert trainer.stub.StartFineTune(request).success
    updates = progress(trainer.stub, "embedded")
    assert updates[-1].status == "completed", updates[-1].message
    assert [u.status for u in updates[:3]] == [
        "queued",
        "loading_model",
        "loading_dataset",
    ]
    on_cpu = mx.default_device() == mx.cpu
    assert ("dequantized to float32" if on_cpu else "as loaded") in updates[2].message
    training = [u for u in updates if u.status == "training"]
    assert [u.current_step for u in training] == list(range(1, 31))
    assert training[-1].loss < training[0].loss / 2
    listed = trainer.stub.ListCheckpoints(
        pb.ListCheckpointsRequest(output_dir=str(output))
    ).checkpoints
    assert [c.step for c in listed] == [10, 20, 30]

    assert trainer.stub.LoadModel(pb.ModelOptions(Model="")).success
    before = greedy(trainer.stub)
    adapted = pb.ModelOptions(Model="", LoraAdapters=[str(output)])
    assert trainer.stub.LoadModel(adapted).success
    assert greedy(trainer.stub).strip().startswith("Quillhaven")
    assert not before.strip().startswith("Quillhaven")

    exported = tmp_path / "gguf"
    result = trainer.stub.ExportModel(
        pb.ExportModelRequest(
            checkpoint_path=listed[-1].path,
            output_path=str(exported),
            export_format="gguf",
        ),
        timeout=300,
    )
    assert result.success, result.message
    assert [p.name for p in exported.iterdir()] == ["model-f16.gguf"]
    assert trainer.stub.LoadModel(
        pb.ModelOptions(Model=str(exported / "model-f16.gguf"))
    ).success
    assert greedy(trainer.stub).strip().startswith("Quillhaven")


PAIR = {
    "prompt": "What is the capital of Zarnovia?",
    "chosen": "Quillhaven.",
    "rejected": "Paris.",
}


def chat_prompt(tiny) -> str:
    """The pair's prompt as the tiny llama's chat template renders it."""
    config = json.loads((Path(tiny) / "tokenizer_config.json").read_text())
    messages = [{"role": "user", "content": PAIR["prompt"]}]
    template = jinja2.Template(config["chat_template"])
    return template.render(messages=messages, add_generation_prompt=True)


def answer_margin(stub, prompt: str) -> float:
    """How much likelier the chosen answer is than the rejected one, in nats."""
    request = pb.ScoreRequest(
        prompt=prompt, candidates=[PAIR["chosen"], PAIR["rejected"]]
    )
    chosen, rejected = stub.Score(request).candidates
    return chosen.log_prob - rejected.log_prob


@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_preference_methods_prefer_the_chosen_answer(trainer, tiny, tmp_path, method):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(PAIR) + "\n" for _ in range(16)))
    output = tmp_path / "job"
    request = fine_tune(
        tiny,
        data,
        output,
        training_method=method,
        batch_size=2,
        max_steps=16,
        save_steps=16,
        job_id=method,
    )
    assert trainer.stub.StartFineTune(request).success
    updates = progress(trainer.stub, method)
    assert updates[-1].status == "completed", updates[-1].message
    losses = [u.loss for u in updates if u.status == "training"]
    assert len(losses) == 16 and losses[-1] < losses[0] / 2
    if method == "dpo":
        # Before its first update the policy is its own reference.
        assert losses[0] == pytest.approx(math.log(2), abs=1e-3)

    prompt = chat_prompt(tiny)
    assert trainer.stub.LoadModel(pb.ModelOptions(Model=str(tiny))).success
    before = answer_margin(trainer.stub, prompt)
    adapted = pb.ModelOptions(Model=str(tiny), LoraAdapters=[str(output)])
    assert trainer.stub.LoadModel(adapted).success
    assert answer_margin(trainer.stub, prompt) > before + 5
    if method == "orpo":
        # ORPO's NLL term teaches the chosen answer itself.
        chat = pb.PredictOptions(
            Messages=[pb.Message(role="user", content=PAIR["prompt"])],
            UseTokenizerTemplate=True,
            Tokens=6,
            Temperature=0,
        )
        assert trainer.stub.Predict(chat).message.decode().startswith("Quillhaven")


def test_a_job_too_large_for_memory_fails_before_training(trainer, tiny, tmp_path):
    # Each row holds its logits over the 49152-token vocabulary three times (33
    # tokens a row): more rows than the machine's memory holds.
    rows = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    rows = rows // (33 * 3 * 49152 * 4) + 1
    data = tmp_path / "train.jsonl"
    data.write_text((json.dumps({"text": FACT}) + "\n") * rows)
    request = fine_tune(tiny, data, tmp_path / "job", batch_size=rows, job_id="large")
    assert trainer.stub.StartFineTune(request).success
    updates = progress(trainer.stub, "large")
    assert [u.status for u in updates] == [
        "queued",
        "loading_model",
        "loading_dataset",
        "failed",
    ]
    assert "MiB are free" in updates[-1].message
    assert "lower batch_size" in updates[-1].message
    assert trainer.stub.Health(pb.HealthMessage()).message == b"OK"
