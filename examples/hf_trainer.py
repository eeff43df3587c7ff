"""transformers.Trainer with zeroinf as its ZeRO engine: one line, `enable()`, before anything
imports transformers. The DeepSpeed config is the one a DeepSpeed user passes, "auto" values
included (transformers fills them from TrainingArguments). A tiny Llama built from LlamaConfig
(no downloads) trains for 20 steps on random tokens with ZeRO-3, parameters and optimizer state
on NVMe (a temp folder), saves with trainer.save_model and loads back with from_pretrained (at
ZeRO-3 straight into zeroinf.Init's partitions).

    python examples/hf_trainer.py [--stage 2|3] [--steps N] [--out DIR]
"""
import zeroinf.integrations.hf

zeroinf.integrations.hf.enable()  # the one line: before transformers is imported

import argparse  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402

import zeroinf  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, choices=(2, 3), default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=None, help="output folder (default: a temp folder)")
    a = p.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="zeroinf-hf-")
    if a.stage == 3:
        zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": out},
                "offload_optimizer": {"device": "nvme", "nvme_path": out},
                "stage3_gather_16bit_weights_on_model_save": True}
    else:
        zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "train_batch_size": "auto", "gradient_clipping": "auto",
                 "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                          "weight_decay": "auto"}},
                 "zero_optimization": zero}

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (4 * a.steps, 32), generator=g)]
    args = transformers.TrainingArguments(out, per_device_train_batch_size=4, max_steps=a.steps, learning_rate=1e-3,
                                          logging_steps=5, report_to=[], use_cpu=True, save_strategy="no",
                                          deepspeed=ds_config, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    print("engine:", type(trainer.model_wrapped).__module__ + "." + type(trainer.model_wrapped).__name__)
    trainer.save_model(out + "/model")
    saved = trainer.model_wrapped.module_state_dict()
    # at stage 3 the Trainer's ZeRO-3 config is still active: from_pretrained builds the model under
    # zeroinf.Init and streams the weights into what it holds, one module at a time
    back = transformers.LlamaForCausalLM.from_pretrained(out + "/model")
    with zeroinf.gathered_parameters(list(back.parameters())):  # full values (a no-op at stage 2)
        same = all(torch.equal(p, saved[n]) for n, p in back.named_parameters())
    print(f"saved and loaded back{' under zeroinf.Init' if a.stage == 3 else ''}: "
          f"{sum(saved[n].numel() for n, _ in back.named_parameters()):,} parameters in {out}/model, "
          f"equal to the engine's: {same}")


if __name__ == "__main__":
    main()
