"""What a llama-server slot swap costs against the prefill it saves (``swap=True``).

    python bench/server_swap_cost.py [--server BIN] [--model GGUF] [--sizes 128,512,1024,2000]

One llama-server (2 slots, ``--cache-ram 0``, a temporary ``--slot-save-path``): for each
prompt size, the prompt is prefilled on slot 0, the slot saved, erased and restored, and the
same prompt sent again. Prints the server's own figures: prefill ms (``timings.prompt_ms``),
``save_ms``, the file's size (``n_written``), ``restore_ms``, and the ``cache_n`` of the prompt
sent after the restore (all but its last token when the restore brought the slot back).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import _llama_server as ls
import httpx

from chatctx.model.paths import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", dest="binary", default=None, help="llama-server binary")
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: SmolLM2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sizes", default="128,512,1024,2000")
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    model = args.model or default_model_path()
    with (
        tempfile.TemporaryDirectory() as folder,
        ls.llama_server(
            ls.find_binary(args.binary),
            model,
            slots=2,
            n_ctx=ls.pad256(max(sizes) + 8),
            threads=args.threads,
            extra=["--slot-save-path", folder + "/", "--cache-ram", "0"],
        ) as server,
        httpx.Client(base_url=server.url, timeout=600) as http,
    ):
        print(
            "| prompt tokens | prefill ms | save ms | file MB | restore ms "
            "| cache_n after the restore | prefill / restore |\n|---|---|---|---|---|---|---|"
        )
        for n in sizes:
            prompt = [1] + [1000 + (i * 7) % 20000 for i in range(n - 1)]
            body = {"prompt": prompt, "n_predict": 1, "id_slot": 0, "cache_prompt": True}
            first, _ = ls.completion(http, body)
            saved = http.post("/slots/0?action=save", json={"filename": f"s{n}.bin"}).json()
            http.post("/slots/0?action=erase", json={})
            restored = http.post("/slots/0?action=restore", json={"filename": f"s{n}.bin"}).json()
            again, _ = ls.completion(http, body)
            prefill = first["timings"]["prompt_ms"]
            restore = restored["timings"]["restore_ms"]
            print(
                f"| {n:,} | {prefill:,.0f} | {saved['timings']['save_ms']:.1f} "
                f"| {saved['n_written'] / 2**20:.1f} | {restore:.1f} "
                f"| {again['timings']['cache_n']:,} | {prefill / restore:.0f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
