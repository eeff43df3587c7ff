"""Shared by the ``zeroinf.Init`` tests (test_stage3_init_*.py): a stage-3 config with the
parameters offloaded to a tier."""


def _cfg(tier, path):
    off = {"device": tier}
    if tier == "nvme":
        off["nvme_path"] = str(path)
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "offload_param": off}}
