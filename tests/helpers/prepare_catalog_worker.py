"""prepare_catalog.prepare with the network fetch replaced by fixture files; for
tests/test_prepare_catalog.py, run in the preparation environment (.venv-prepare).

    .venv-prepare/bin/python tests/helpers/prepare_catalog_worker.py DOWNLOADS_JSON DATA_DIR NAME [NAME ...]

DOWNLOADS_JSON maps each URL a builder fetches to a local file standing in for what that URL
serves. Only TFDS's downloader (the HTTP fetch) is replaced: the download manager, its
download folder and `.INFO` records, the extraction with `tf.io.gfile`, the builder's
`_split_generators` and `_generate_examples` and the array_record writer are TFDS's own.
One process prepares every name, so TensorFlow is imported once.
"""

import contextlib
import json
import shutil
import sys
from pathlib import Path

# The project's root (its modules) and tests/ (the helpers package) on the path, as pytest has them.
sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import promise  # noqa: E402
from tensorflow_datasets.core.download import checksums, download_manager, downloader  # noqa: E402

from tools import prepare_catalog  # noqa: E402


class FixtureDownloader:
    """TFDS's `_Downloader` interface, serving each URL from a local file instead of the network.

    A URL whose checksum TFDS has registered gets that registered identity, as the real artifact
    would (the fixture stands in for it); any other gets the fixture's own size and SHA-256.
    """

    def __init__(self, files: dict[str, str], registered: dict):
        self.files, self.registered = files, registered

    def tqdm(self):
        # no progress bars in a test's output
        return contextlib.nullcontext()

    def increase_tqdm(self, url_info) -> None:
        pass

    def download(self, url: str, destination_path, verify: bool = True):
        if url not in self.files:
            raise AssertionError(f"the test has no fixture for {url}")
        path = Path(destination_path) / Path(url.split("?")[0]).name
        shutil.copyfile(self.files[url], path)
        url_info = self.registered.get(url) or checksums.compute_url_info(path)
        return promise.Promise.resolve(downloader.DownloadResult(path=path, url_info=url_info))


def main(downloads_json: str, data_dir: str, *names: str) -> None:
    files = json.loads(Path(downloads_json).read_text())
    for name in names:
        registered = type(prepare_catalog.builder_of(name, data_dir)).url_infos or {}
        fake = FixtureDownloader(files, registered)
        download_manager.get_downloader = lambda *args, fake=fake, **kwargs: fake
        print(f"prepared {name} in {prepare_catalog.prepare(name, data_dir)}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
