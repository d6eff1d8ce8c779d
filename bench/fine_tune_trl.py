"""Part 15's trl side, run by the trl environment's Python: SFT LoRA on a Hugging
Face folder as LocalAI's trl backend trains it (transformers, peft on every linear
layer, trl's SFTTrainer; float32 and ``use_cpu`` without CUDA), with the same
steps, batch, rank, alpha and learning rate as the MLX sides. Prints one JSON
line: tokens per second after the first step, seconds in all, peak RSS.

``python bench/fine_tune_trl.py MODEL_FOLDER TRAIN_JSONL STEPS BATCH RANK ALPHA LR``
"""

import json
import resource
import sys
import time


def main(argv: list[str]) -> None:
    folder, data, steps, batch, rank, alpha, rate = argv
    began = time.perf_counter()
    import torch
    from datasets import load_dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16 if cuda else torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    lora = LoraConfig(
        r=int(rank),
        lora_alpha=float(alpha),
        lora_dropout=0.0,
        target_modules="all-linear",
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    dataset = load_dataset("json", data_files=data, split="train")

    class Clock(TrainerCallback):
        """Each step's seconds and the tokens seen by its end."""

        def __init__(self):
            self.steps = []

        def on_step_begin(self, args, state, control, **kwargs):
            self._tic = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self._tic
            self.steps.append((seconds, state.num_input_tokens_seen))

    clock = Clock()
    config = SFTConfig(
        output_dir=str(time.time_ns()),
        max_steps=int(steps),
        per_device_train_batch_size=int(batch),
        gradient_accumulation_steps=1,
        learning_rate=float(rate),
        warmup_steps=0,
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        max_length=512,
        packing=False,
        use_cpu=not cuda,
        bf16=cuda,
        include_num_input_tokens_seen=True,
        seed=0,
    )
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    # From the second step on: the first one warms up.
    seconds = sum(s for s, _ in clock.steps[1:])
    tokens = clock.steps[-1][1] - clock.steps[0][1]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps(
            {
                "tokens_per_second": tokens / seconds,
                "seconds": time.perf_counter() - began,
                "peak_rss_gb": peak / 1e9,
                "device": "cuda" if cuda else "cpu",
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
