"""Process-wide defaults of dtorch_ops."""
import dataclasses


@dataclasses.dataclass
class Config:
    # The seed's perDevicePerProcess: device tensors are produced by one worker process per device,
    # so a pair whose promise such a worker fulfils must be able to cross processes ("file" kind).
    # The default for promise_kind_for(..., per_device_per_process=None).
    per_device_per_process: bool = False


config = Config()
