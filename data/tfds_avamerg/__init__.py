"""tensorflow-datasets builder for AvaMERG: manual download, array_record output, no TensorFlow needed."""

from data.tfds_avamerg.avamerg_dataset_builder import (
    MANUAL_DOWNLOAD_INSTRUCTIONS,
    AvamergConfig,
    Builder,
    from_tfds_example,
    tfds_features,
    to_tfds_example,
)

Avamerg = Builder

__all__ = [
    "MANUAL_DOWNLOAD_INSTRUCTIONS",
    "Avamerg",
    "AvamergConfig",
    "Builder",
    "build",
    "from_tfds_example",
    "tfds_features",
    "to_tfds_example",
]


def build(manual_dir: str, data_dir: str, config: AvamergConfig | str = "lite") -> Builder:
    """Build the dataset into `data_dir` as array_record from the AvaMERG files in `manual_dir`."""
    import tensorflow_datasets as tfds

    builder = Builder(data_dir=data_dir, config=config, file_format="array_record")
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
    return builder
