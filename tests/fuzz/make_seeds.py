#!/usr/bin/env python3
"""Writes the seed corpora under tests/fuzz/corpus/ (deterministic; rerun after a
format change and check the files in). ok-* seeds must be accepted by their target
and bad-* seeds refused: the replay tests check both. Other names in a corpus
directory (inputs libFuzzer found) only must not crash."""
import json
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def js(value):
    return json.dumps(value, ensure_ascii=False)


# ---- info_fuzz: JSON text ----
INIT = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3,
        "buffer_bytes": 1 << 20, "num_buffers": 2, "timeout_ms": 30000}
UPDATE = {"names": ["model.embed.weight", "model.layers.0.q.bias", "lm_head.scale"],
          "dtype_names": ["bfloat16", "torch.float32", "half"], "shapes": [[32, 64], [64], []]}

write("info_fuzz", "ok-init_info.json", js(INIT))
write("info_fuzz", "ok-init_info_minimal.json",
      js({"master_address": "trainer-0", "master_port": 1, "rank_offset": 1, "world_size": 2, "checksums": True}))
write("info_fuzz", "ok-update_info.json", js(dict(UPDATE, commit="staged")))
write("info_fuzz", "ok-update_info_split.json",
      js({"names": ["a", "big", "z", "empty"], "dtype_names": ["int8", "float32", "float64", "uint8"],
          "shapes": [[3], [3000], [2, 2], [0, 5]]}))
# Valid metadata whose plan in 4 KiB buffers would be 2^28 buckets: must be refused.
write("info_fuzz", "ok-update_info_1tib_tensor.json",
      js({"names": ["huge"], "dtype_names": ["uint8"], "shapes": [[1 << 40]]}))
write("info_fuzz", "ok-config.json", js({"backend": "tcp", "timeout_ms": 5000, "processing_threads": 2,
                                         "commit": "in_place"}))
write("info_fuzz", "ok-wire_params.json", js({"buffer_bytes": 4096, "num_buffers": 64, "checksums": False}))
write("info_fuzz", "bad-init_info_port0.json", js(dict(INIT, master_port=0)))
write("info_fuzz", "bad-init_info_rank_offset.json", js(dict(INIT, rank_offset=3)))
write("info_fuzz", "bad-init_info_unknown_member.json", js(dict(INIT, master_addr="x")))
write("info_fuzz", "bad-init_info_buffer_bytes.json", js(dict(INIT, buffer_bytes=4095)))
write("info_fuzz", "bad-update_lengths.json", js(dict(UPDATE, shapes=[[1]])))
write("info_fuzz", "bad-update_dtype.json", js(dict(UPDATE, dtype_names=["bfloat16", "float31", "half"])))
write("info_fuzz", "bad-update_duplicate.json", js(dict(UPDATE, names=["a", "b", "a"])))
write("info_fuzz", "bad-update_negative.json", js(dict(UPDATE, shapes=[[32, -64], [64], []])))
write("info_fuzz", "bad-update_overflow.json", js(dict(UPDATE, shapes=[[1 << 62, 4], [64], []])))
# Not a number a double can hold: nlohmann says out_of_range, not parse_error.
write("info_fuzz", "bad-number_1e999.json", '{"master_address": "h", "master_port": 1e999}')
write("info_fuzz", "bad-deep.json", "[" * 200 + "]" * 200)
# A mistyped member whose excerpt (cut at 37 bytes) lands inside a UTF-8 character.
write("info_fuzz", "bad-utf8_excerpt.json", js({"names": "x" + "\u00e9" * 30, "dtype_names": [], "shapes": []}))
write("info_fuzz", "bad-not_json.txt", "master_address=127.0.0.1\n")
# Found by info_fuzz: nlohmann's parse error quotes the bytes where it stopped.
write("info_fuzz", "bad-utf8_parse_error.json", b'{"master_address": "h", "\xff\xff\xff\x1fbuffer_bytes": 4095}')

# ---- layout_fuzz: a tcp_sharded update_info ----
LLAMA = {"names": ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                   "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
                   "model.layers.0.self_attn.o_proj.weight", "model.layers.0.input_layernorm.weight",
                   "lm_head.weight"],
         "dtype_names": ["bfloat16"] * 7, "shapes": [[100, 16], [16, 16], [8, 16], [8, 16], [16, 16], [16], [100, 16]]}
SHARD0 = {"mesh": [2], "placements": ["shard(0)"]}
write("layout_fuzz", "ok-fsdp_to_vllm_tp2.json",
      js(dict(LLAMA, layout={"source": SHARD0, "destination": {"preset": "vllm_llama", "tp_size": 2}})))
write("layout_fuzz", "ok-2d_mesh_replicated_norm.json",
      js(dict(LLAMA, layout={"source": {"mesh": [2, 2], "ranks": [3, 2, 1, 0], "placements": ["shard(0)", "replicate"],
                                        "tensors": {"model.layers.0.input_layernorm.weight": ["replicate", "replicate"]}},
                             "destination": {"preset": "vllm_llama", "tp_size": 4, "vocab_padding": 32}})))
write("layout_fuzz", "ok-explicit_pieces.json",
      js({"names": ["a", "b"], "dtype_names": ["float32", "float32"], "shapes": [[4, 4], [2, 4]],
          "layout": {"source": {"mesh": [3], "placements": ["shard(1)"]},
                     "destination": {"workers": [[{"name": "ab", "dtype": "float32", "shape": [7, 4], "pieces": [
                         {"source": "a", "offset": [0, 0], "extent": [4, 4], "at": [0, 0]},
                         {"source": "b", "offset": [0, 1], "extent": [2, 3], "at": [4, 1]}]}]]}}}))
write("layout_fuzz", "bad-overlapping_pieces.json",
      js({"names": ["a"], "dtype_names": ["float32"], "shapes": [[4]],
          "layout": {"source": {"mesh": [1]}, "destination": {"workers": [[{"name": "x", "dtype": "float32", "shape": [4],
              "pieces": [{"source": "a", "offset": [0], "extent": [3], "at": [0]},
                         {"source": "a", "offset": [1], "extent": [3], "at": [1]}]}]]}}}))
write("layout_fuzz", "bad-indivisible_tp.json",
      js(dict(LLAMA, layout={"source": SHARD0, "destination": {"preset": "vllm_llama", "tp_size": 3}})))
write("layout_fuzz", "bad-shard_dim.json",
      js(dict(LLAMA, layout={"source": {"mesh": [2], "placements": ["shard(5)"]},
                             "destination": {"preset": "vllm_llama", "tp_size": 1}})))

# torch_ipc: a PyTorch trainer's handles (examples/torch_ipc/refit_ipc.py).
GPU = "GPU-6f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8"


def torch_entry(size, stride, offset=0, storage_bytes=1 << 16, handle="ab" * 64):
    return {GPU: {"handle": handle, "storage_offset_bytes": 512, "storage_bytes": storage_bytes, "offset": offset,
                  "size": size, "stride": stride}}


TORCH = dict(UPDATE, ipc_handles=[torch_entry([32, 64], [64, 1]), torch_entry([64], [1], 5), torch_entry([], [])])
write("info_fuzz", "ok-torch_update_info.json", js(TORCH))
write("info_fuzz", "bad-torch_transposed.json",
      js(dict(TORCH, ipc_handles=[torch_entry([32, 64], [1, 32])] + TORCH["ipc_handles"][1:])))
write("info_fuzz", "bad-torch_outside_storage.json",
      js(dict(TORCH, ipc_handles=TORCH["ipc_handles"][:1] + [torch_entry([64], [1], 1 << 62)] +
              TORCH["ipc_handles"][2:])))
# torch 2.x: the caching allocator's shareable handle (version 2, 'c', 64 bytes).
write("info_fuzz", "ok-torch_shareable_handle.json",
      js(dict(TORCH, ipc_handles=[torch_entry([32, 64], [64, 1], handle="0263" + "ab" * 64)] +
              TORCH["ipc_handles"][1:])))
write("info_fuzz", "bad-torch_expandable_segment.json",
      js(dict(TORCH, ipc_handles=[torch_entry([32, 64], [64, 1], handle="0265" + "ab" * 40)] +
              TORCH["ipc_handles"][1:])))
write("info_fuzz", "bad-torch_handle_65_bytes.json",
      js(dict(TORCH, ipc_handles=[torch_entry([32, 64], [64, 1], handle="ab" * 65)] + TORCH["ipc_handles"][1:])))

# ---- frame_fuzz: [u32 big-endian length][JSON] ... ----


def frame(body):
    if not isinstance(body, (bytes, bytearray)):
        body = js(body).encode()
    return struct.pack(">I", len(body)) + body


write("frame_fuzz", "ok-start.bin", frame({"id": 1, "method": "start_weight_update", "params": {}}))
write("frame_fuzz", "ok-no_params.bin", frame({"id": 7, "method": "weight_info"}))
write("frame_fuzz", "ok-session.bin",
      frame({"id": 2, "method": "init_transfer_engine", "params": {"init_info": INIT}}) +
      frame({"id": 3, "method": "update_weights", "params": {"update_info": UPDATE}}) +
      frame({"id": 4, "method": "finish_weight_update", "params": {"weight_version": 12}}))
write("frame_fuzz", "bad-missing_id.bin", frame({"method": "weight_info"}))
write("frame_fuzz", "bad-unknown_member.bin", frame({"id": 1, "method": "weight_info", "param": {}}))
write("frame_fuzz", "bad-not_object.bin", frame([1, 2, 3]))
write("frame_fuzz", "bad-oversize.bin", b"\xff\xff\xff\xff{}")
write("frame_fuzz", "bad-truncated.bin", frame({"id": 1, "method": "weight_info"})[:-3])
write("frame_fuzz", "bad-short_prefix.bin", b"\x00\x00")
write("frame_fuzz", "bad-malformed.bin", frame(b'{"id": 1, "method": }'))
write("frame_fuzz", "bad-1e999.bin", frame(b'{"id": 1, "method": "x", "params": [1e999]}'))
write("frame_fuzz", "bad-deep.bin", frame(b'{"id": 1, "method": "x", "params": ' + b"[" * 500 + b"]" * 500 + b"}"))
# The error answer quotes the mistyped id; its excerpt must stay valid UTF-8.
write("frame_fuzz", "bad-utf8_excerpt.bin", frame({"id": "x" + "\u00e9" * 30, "method": "x"}) +
      frame({"id": 5, "method": "weight_info"}))

# ---- wire_fuzz: description, then an XOR mask over the correct stream ----
# description: config (bit 0 checksums, bits 1-2 buffer 4 KiB << n), tensor count,
# per tensor (dtype index, rank, u16 dims), u64 last_seq (halved), then the mask.
UPDATE_OFF = {"magic": 0, "reserved": 4, "seq": 8, "digest": 16, "tensors": 24, "buckets": 32, "payload": 40}
BUCKET_OFF = {"magic": 0, "flags": 4, "index": 8, "payload": 16, "checksum": 24}


def describe(config, tensors, last_seq):
    out = bytes([config, len(tensors)])
    for dtype_index, dims in tensors:
        out += bytes([dtype_index, len(dims)]) + b"".join(struct.pack("<H", d) for d in dims)
    return out + struct.pack("<Q", last_seq * 2)


def mask(patches, length=None):
    """patches: (offset, bytes) into the stream (update header at 0, bucket k's header
    at 48 + 32 k)."""
    end = max([o + len(b) for o, b in patches] + [0])
    m = bytearray(end if length is None else length)
    for o, b in patches:
        m[o:o + len(b)] = b
    return bytes(m)


def bucket(k, field):
    return 48 + 32 * k + BUCKET_OFF[field]


# dtype indices: 1 uint8, 4 int32, 6 float16, 7 bfloat16, 8 float32, 9 float64
PACKED = [(7, [32, 16]), (8, [5]), (1, []), (6, [0, 3])]
SPLIT = [(8, [3000]), (9, [2, 2])]  # 12000 bytes in 4 KiB buffers: 3 chunks, then a packed bucket
write("wire_fuzz", "ok-empty_update.bin", describe(0, [], 0))
write("wire_fuzz", "ok-packed.bin", describe(1, PACKED, 41))
write("wire_fuzz", "ok-split.bin", describe(0, SPLIT, 7))
write("wire_fuzz", "ok-large_buffers.bin", describe(0b111, SPLIT, 1))
# Fields the worker does not check may differ.
write("wire_fuzz", "ok-reserved_and_checksum.bin",
      describe(0, SPLIT, 7) + mask([(UPDATE_OFF["reserved"], b"\x01\x02"), (bucket(1, "checksum"), b"\xff"),
                                    (bucket(2, "flags"), b"\x00\x80")]))
write("wire_fuzz", "bad-update_magic.bin", describe(0, SPLIT, 7) + mask([(UPDATE_OFF["magic"], b"\x01")]))
write("wire_fuzz", "bad-update_seq.bin", describe(0, SPLIT, 10) + mask([(UPDATE_OFF["seq"], b"\x01")]))
write("wire_fuzz", "bad-update_digest.bin", describe(1, PACKED, 3) + mask([(UPDATE_OFF["digest"] + 7, b"\x40")]))
write("wire_fuzz", "bad-update_tensors.bin", describe(1, PACKED, 3) + mask([(UPDATE_OFF["tensors"], b"\x04")]))
write("wire_fuzz", "bad-update_buckets.bin", describe(0, SPLIT, 3) + mask([(UPDATE_OFF["buckets"], b"\x01")]))
write("wire_fuzz", "bad-bucket_magic.bin", describe(0, SPLIT, 3) + mask([(bucket(3, "magic") + 3, b"\x80")]))
write("wire_fuzz", "bad-bucket_index.bin", describe(0, SPLIT, 3) + mask([(bucket(1, "index"), b"\x03")]))
write("wire_fuzz", "bad-bucket_payload.bin", describe(0, SPLIT, 3) + mask([(bucket(2, "payload"), b"\x10")]))
write("wire_fuzz", "bad-bucket_checksum_flag.bin", describe(1, PACKED, 3) + mask([(bucket(0, "flags"), b"\x01")]))

# ---- delta_fuzz: config, wire kind, u16 element count, base, payload ----
def delta_input(config, kind, n, base, payload):
    return bytes([config, kind]) + struct.pack("<H", n) + base + payload


def leb128(v):
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def zstd_frame(data):
    """A zstd -1 frame that says its content size (the CLI writes it for a file)."""
    import subprocess
    import tempfile
    with tempfile.NamedTemporaryFile() as f:
        f.write(data)
        f.flush()
        return subprocess.run(["zstd", "-1", "-q", "-c", "--no-check", f.name], check=True,
                              capture_output=True).stdout


BASE16 = bytes((i * 37) & 0xFF for i in range(64))  # 32 bf16 elements
write("delta_fuzz", "ok-full.bin", delta_input(1, 0, 32, BASE16, bytes(64)))
write("delta_fuzz", "ok-sparse.bin", delta_input(1, 1, 32, BASE16, leb128(3) + b"\x01\x02" + leb128(27) + b"\x03\x04"))
write("delta_fuzz", "ok-sparse_empty.bin", delta_input(1, 1, 32, BASE16, b""))
write("delta_fuzz", "ok-bitmap.bin", delta_input(1, 2, 32, BASE16, b"\x81\x00\x00\x80" + bytes(6)))
XOR = bytearray(64)
XOR[10] = 1
XOR[41] = 3
write("delta_fuzz", "ok-xor_zstd.bin", delta_input(1, 3, 32, BASE16, zstd_frame(bytes(XOR))))
# xor_planes: changed count, frame sizes (bitmap, plane 0, plane 1), frames.
bitmap = bytes([0x20, 0, 0x01, 0])  # elements 5 and 16
frames = [zstd_frame(bitmap), zstd_frame(b"\x01\x03"), zstd_frame(b"\x00\x00")]
write("delta_fuzz", "ok-xor_planes.bin",
      delta_input(1, 4, 32, BASE16, struct.pack("<4Q", 2, *map(len, frames)) + b"".join(frames)))
write("delta_fuzz", "bad-unknown_encoding.bin", delta_input(1, 9, 32, BASE16, b""))
write("delta_fuzz", "bad-sparse_past_the_end.bin", delta_input(1, 1, 32, BASE16, leb128(32) + b"\x01\x02"))
write("delta_fuzz", "bad-bitmap_count.bin", delta_input(1, 2, 32, BASE16, b"\x03\x00\x00\x00\x01\x02"))
write("delta_fuzz", "bad-xor_planes_count.bin",
      delta_input(1, 4, 32, BASE16, struct.pack("<4Q", 3, *map(len, frames)) + b"".join(frames)))
write("delta_fuzz", "bad-xor_planes_1_byte.bin",
      delta_input(0, 4, 64, BASE16, struct.pack("<4Q", 2, *map(len, frames)) + b"".join(frames)))
write("delta_fuzz", "bad-xor_zstd_size.bin", delta_input(1, 3, 31, BASE16[:62], zstd_frame(bytes(XOR))))

print("seeds written under", os.path.join(HERE, "corpus"), file=sys.stderr)
