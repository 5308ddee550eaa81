"""TRL 1.16's `GRPOTrainer`, unchanged, training against tlt-serve through `python/tlt_trl` (on the CPU).

Usage: python3 check_trl_grpo.py BASE_URL MODEL_DIR WEIGHTS_DIR [API_KEY]

What runs is TRL's own code: `GRPOConfig(use_vllm=True, vllm_mode="server")`, `GRPOTrainer.__init__` (which builds its
`VLLMGeneration`, whose `_init_vllm` builds the client and calls `init_communicator`, then reads
`model_config.logprobs_mode` from `/server_info`), and `trainer.train()` for two steps: each step's generation goes
through TRL's `VLLMClient.generate` (`/v1/completions`, token-id prompts, `n` = num_generations, its
`parse_logprobs`), preceded by TRL's `sync_weights` (`update_named_params` over the model's parameters, then
`reset_prefix_cache`), the loss with vLLM's log-probs for the importance-sampling correction, and an AdamW step.
`tlt_trl.install` only swaps the weight transport of TRL's client (a checkpoint under WEIGHTS_DIR and
`/update_weights_from_disk`, instead of vLLM's NCCL engine, which needs vLLM and a CUDA device) and sends the
server's API key (`Authorization: Bearer`) when one is given.

Checks, one line each; the first failure exits non-zero:
- the trainer constructs against the server (TRL's start-up: health, `/v1/models`, `/server_info`);
- two training steps complete, with two weight syncs: the server's weight version is the client's last;
- the second sync carries the weights after the first optimizer step: they differ from the first sync's, which are
  the model's initial weights, tensor by tensor, by the bit;
- the rollouts TRL read have log-probs, and they are the trainer's own: TRL's importance-sampling ratio (its
  recomputed probability over the served one) is within 1e-3 of 1 at its min, mean and max.
The last line is JSON: the last synced directory and the weight version, for the caller to decode in process and
compare with what the server serves.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import tlt_trl  # noqa: E402


def fail(msg):
    print(f"FAIL {msg}")
    sys.exit(1)


def main():
    base_url, model_dir, weights_dir = sys.argv[1:4]
    api_key = sys.argv[4] if len(sys.argv) > 4 else None
    import torch
    from datasets import Dataset
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    client_class = tlt_trl.install(weights_dir=weights_dir, api_key=api_key)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    prompts = ["Hi!", "1 - 1 =", "abc", "x y z"]
    dataset = Dataset.from_dict({"prompt": prompts * 4})

    def reward(completions, **kwargs):
        # Varies between samples of one prompt, so every group has advantages and the step changes the weights.
        return [sum(map(ord, c)) % 7 / 7.0 for c in completions]

    args = GRPOConfig(
        output_dir=os.path.join(weights_dir, "trainer-out"),
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=base_url,
        vllm_server_timeout=60,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=0.05,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer)
    client = trainer.vllm_generation.vllm_client
    if not isinstance(client, client_class):
        fail(f"TRL built {type(client).__name__}, not tlt_trl's client")
    print(f"ok construct: GRPOTrainer(use_vllm=True, vllm_mode='server') against {base_url}, client "
          f"{type(client).__name__} (TRL's VLLMClient, weights through /update_weights_from_disk)")

    result = trainer.train()
    synced = tlt_trl.synced_dirs(client)
    served = client._get(f"{base_url}/get_weight_version")["weight_version"]
    if result.global_step != 2 or len(synced) != 2 or served != "2":
        fail(f"steps {result.global_step}, syncs kept {synced}, served version {served!r}")
    print(f"ok train: 2 GRPO steps, 2 weight syncs, the server on version {served!r}")

    first, second = (load_file(os.path.join(d, "model.safetensors")) for d in synced)
    names = [n for n in initial if n in first]
    if not names or any(not torch.equal(first[n], initial[n]) for n in names):
        fail("the first sync is not the initial weights")
    changed = [n for n in names if not torch.equal(first[n], second[n])]
    if not changed:
        fail("the second sync carries the same weights as the first: no optimizer step reached the server")
    print(f"ok sync: the first sync is the initial weights by the bit ({len(names)} tensors); the second differs in "
          f"{len(changed)} of them (the step's update)")

    logged = [h for h in trainer.state.log_history if "loss" in h]
    if len(logged) != 2 or not any(k.startswith("sampling/") or "importance" in k for k in logged[0]):
        fail(f"TRL logged no rollout log-prob metrics: {logged}")
    ratio = {k.rsplit("/", 1)[1]: logged[0][k] for k in logged[0] if k.startswith("sampling/importance_sampling_ratio/")}
    if not ratio or not all(abs(v - 1.0) < 1e-3 for v in ratio.values()):
        fail(f"TRL's importance-sampling ratios (its recomputed log-probs over the served ones) are off 1: {ratio}")
    print(f"ok rollouts: TRL's importance-sampling ratio of its own log-probs over the served ones, step 1: "
          + ", ".join(f"{k} {v:.6f}" for k, v in sorted(ratio.items())))
    print(json.dumps({"dir": synced[-1], "weight_version": served}))


if __name__ == "__main__":
    main()
