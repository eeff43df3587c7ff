"""ZeRO runtime: the engine (:mod:`.engine`), the stage 0–2 flat-parameter manager
(:mod:`.flat`), the sub-group optimizer on CPU or NVMe (:mod:`.optimizer`), loss scaling
(:mod:`.loss_scaler`), DeepSpeed's LR schedules (:mod:`.lr_schedules`) and stage 3 (:mod:`.stage3`).
Submodules are imported on use, so importing this package costs nothing.
"""
