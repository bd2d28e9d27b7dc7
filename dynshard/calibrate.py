"""``python -m dynshard.calibrate --out profile.json`` (under torchrun, as the job is launched): the entry
point of :mod:`dynshard.autodist.calibrate`, where the calibration lives."""

from .autodist.calibrate import SIZES, calibrate, collective_fit, compute_rates, main

__all__ = ["SIZES", "calibrate", "collective_fit", "compute_rates", "main"]

if __name__ == "__main__":
    main()
