"""Untrusted serialized "file" promises: whatever text from_serialized is given (a real handle
truncated, with a character flipped, deleted or doubled; malformed text; a handle naming a file of
dtorch's name form that is no control segment, or a real pair as of the other value type; a valid
handle with value options other than its consumer's), it fails to parse or is refused at first
use with a dtorch error, or does nothing: no crash (fuzzed in a subprocess), no hang, and nothing
reaches the real pairs. The contract is the comment at the top of csrc/core/kinds/file/file_kind.h.

Part of the failure tests of test_file_failures.py, whose helpers and fixtures
(file_failure_helpers.py) it shares. One spawned producer process serves the whole module (the
`producer` fixture). After every test nothing of the processes it used may be left in /dev/shm
(the autouse `nothing_left_in_shm`).
"""
import json
import os

import pytest
import torch

import dtorch_ops
import file_workers
from conftest import WAIT_MS
from dtorch_ops import errors
from file_failure_helpers import (SHM, file_pair, names_owned_by, own_name_prefix, remove_quietly,
                                  run_python, segment_of)
# Fixtures: pytest finds them in this module's namespace (nothing_left_in_shm is autouse).
from file_failure_helpers import nothing_left_in_shm, producer  # noqa: F401, F811


# ---- 8. untrusted serialized promises ----------------------------------------------------------


def single_character_variants(handle: str) -> list:
    """Every bit flip of every character, and its deletion, doubling and replacement by a few
    characters that matter to the parser."""
    variants = []
    for i, c in enumerate(handle):
        replacements = {chr(ord(c) ^ (1 << bit)) for bit in range(8)}
        replacements |= set(":0gA/.\x00")
        variants += [handle[:i] + r + handle[i + 1:] for r in sorted(replacements) if r != c]
        variants += [handle[:i] + handle[i + 1:], handle[:i] + c + handle[i:]]
    return variants


# Every value option a serialized tensor promise may carry ("" for none): TensorCodec's closed set.
VALUE_OPTIONS = ("", "ipc", "zero_copy", "device=cpu")


def with_other_value_options(handle: str) -> list:
    """`handle` with its value options stripped, replaced by each other valid one, or appended
    where it had none: valid handles naming the same pair, with a delivery its consumer did not
    choose."""
    base = ":".join(handle.split(":")[:6])
    variants = [base + (":" + options if options else "") for options in VALUE_OPTIONS]
    return [variant for variant in variants if variant != handle]


def make_decoy_segments(prefix: str) -> dict:
    """Files in /dev/shm with names of dtorch's form (owned by this live process, so nobody reaps
    them meanwhile) that are not control segments: kind -> name."""
    decoys = {}

    def path_for(kind):
        name = prefix + os.urandom(16).hex()
        decoys[kind] = name
        return os.path.join(SHM, name)

    def write(kind, data, mode):
        fd = os.open(path_for(kind), os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
        try:
            os.fchmod(fd, mode)  # not narrowed by the umask
            os.write(fd, data)
        finally:
            os.close(fd)

    write("mode_0644", bytes(4096), 0o644)
    write("garbage", os.urandom(4096), 0o600)
    write("wrong_size", bytes(100), 0o600)
    write("empty", b"", 0o600)
    os.mkdir(path_for("directory"), 0o700)
    os.mkfifo(path_for("fifo"), 0o600)
    os.symlink("/etc/passwd", path_for("symlink"))
    return decoys


@pytest.mark.timeout(180)
def test_from_serialized_refuses_untrusted_handles(producer):
    """Run in a subprocess, so that a crash shows as its exit status: each variant of a real
    handle either fails to parse (InvalidHandleError / ValueError / TypeError), or its first use
    (set_value) raises a dtorch error (a RuntimeError) or does nothing. No crash, no hang, and
    nothing reaches the real pairs: they stay pending and then take values through their
    genuine handles. A third real pair has explicit value options (as a CUDA build's default
    pair has "ipc"): its handle truncated at the options' field, or with other options, is a
    valid handle of another delivery, refused at use."""
    real, real_future = file_pair()
    void_real, void_future = file_pair(dtorch_ops.VoidPromise)
    cpu_real = dtorch_ops.TensorPromise(kind="file", device="cpu")
    cpu_future = cpu_real.get_future()
    handle, void_handle, cpu_handle = real.serialize(), void_real.serialize(), cpu_real.serialize()
    assert cpu_handle.endswith(":device=cpu")
    magic, version, kind, type_name, segment, nonce, *_ = handle.split(":")
    prefix = own_name_prefix()
    assert segment.startswith(prefix)
    doorbells = names_owned_by({os.getpid()}) - {segment, segment_of(void_handle),
                                                  segment_of(cpu_handle)}
    other_nonce = os.urandom(16).hex()
    non_dtorch = os.path.join(SHM, f"not_dtorch_fuzz_{os.getpid()}")
    with open(non_dtorch, "wb") as f:
        f.write(bytes(4096))
    os.chmod(non_dtorch, 0o600)
    decoys = make_decoy_segments(prefix)
    try:
        def with_segment(name, nonce_hex=nonce, type_name="tensor"):
            return f"{magic}:{version}:{kind}:{type_name}:{name}:{nonce_hex}"

        # The variants whose refusal must come at first use, with what the error must say.
        refused_at_use = {
            with_segment(segment, other_nonce): "the nonce does not match",
            with_segment(decoys["mode_0644"]): "mode 0600",
            with_segment(decoys["garbage"]): "no control block of this format",
            with_segment(decoys["wrong_size"]): "has 100 bytes, expected 4096",
            with_segment(decoys["empty"]): "has 0 bytes",
            with_segment(decoys["directory"]): "is not a shared memory segment",
            with_segment(decoys["fifo"]): "not a segment of this user with mode 0600",
            with_segment(decoys["symlink"]): "is not a shared memory segment",
        }
        for doorbell in doorbells:
            refused_at_use[with_segment(doorbell)] = "no control block of this format"
        # A real tensor pair named as a void one and the other way round: parsed, refused on use.
        typed_variants = [
            ("VoidPromise", with_segment(segment, type_name="void"),
             "its value type or creator does not match"),
            ("TensorPromise", with_segment(segment_of(void_handle), void_handle.split(":")[5]),
             "its value type or creator does not match"),
        ]
        # Valid handles of the real tensor pairs with other value options than the consumer's.
        altered_options = {variant for genuine in (handle, cpu_handle)
                           for variant in with_other_value_options(genuine)}
        malformed = [
            "", ":", "::::::", "dtorch-promise", "dtorch-promise:1", "dtorch-promise:1:file:",
            "dtorch-promise:1:file:tensor", "dtorch-promise:1:file:tensor::",
            "dtorch-promise:1:file:tensor:::", f"dtorch-promise:2:file:tensor:{segment}:{nonce}",
            f"dtorch-promise:1:memory:tensor:{segment}:{nonce}",
            f"dtorch-promise:1:network:tensor:{segment}:{nonce}",
            f"dtorch-promise:1:file:tensor:{segment}:{nonce}:",
            f"dtorch-promise:1:file:tensor:{segment}:{nonce.upper()}",
            f"dtorch-promise:1:file:tensor:{segment}:{nonce[:-1]}",
            f"dtorch-promise:1:file:tensor:{segment}:{nonce}0",
            f" {handle}", f"{handle} ", f"{handle}\n", handle.upper(),
            with_segment("/dev/shm/" + segment), with_segment("../../etc/passwd"),
            with_segment("/etc/passwd"), with_segment(os.path.basename(non_dtorch)),
            with_segment("dtorch_../../../../etc/passwd"),
            with_segment(prefix.replace(str(os.getpid()), "0") + "0" * 32),
            with_segment(f"dtorch_{2**31}-1_" + "0" * 32),
            with_segment(f"dtorch_1-{'9' * 21}_" + "0" * 32),
            with_segment(segment + "0"), with_segment(segment[:-1]),
            with_segment(segment.upper()), with_segment(segment + "\x00"),
            with_segment("dtorch_1-1-1_" + "0" * 32),  # well formed, names nothing: a no-op
            handle + "\x00", handle.replace(":", "\x00", 1), handle + "\ud800",
            handle + "é", "x" * 513, "dtorch-promise:1:file:" + "a" * 1_000_000,
            "dtorch-promise:1:file:tensor:" + ":".join(["x"] * 100),
        ]
        generated = [variant for genuine in (handle, cpu_handle)
                     for variant in [genuine[:k] for k in range(len(genuine))] +
                     single_character_variants(genuine)]
        variants = [("TensorPromise", text) for text in malformed + generated]
        variants += [("TensorPromise", text) for text in refused_at_use]
        variants += [("TensorPromise", text) for text in sorted(altered_options)]
        variants += [(cls, text) for cls, text, _ in typed_variants]
        variants += [("TensorPromise", void_handle)]  # a VoidPromise's handle
        variants = [(cls, text) for cls, text in dict.fromkeys(variants)
                    if (cls, text) not in {("TensorPromise", handle), ("VoidPromise", void_handle),
                                           ("TensorPromise", cpu_handle)}]

        code = "import file_workers; file_workers.fuzz_from_serialized_main()"
        returncode, out, err = run_python(code, stdin=json.dumps(variants), timeout_s=150)
        results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        crashed_on = variants[len(results)] if len(results) < len(variants) else None
        assert returncode == 0 and not crashed_on, (
            f"the fuzzing process ended with {returncode} at variant {crashed_on!r}; "
            f"stderr:\n{err[-3000:]}")
        assert [r["i"] for r in results] == list(range(len(variants)))

        wrong = []
        for (cls, text), result in zip(variants, results):
            stage = result["stage"]
            if stage == "parse" and not (result["value"] or result["type"]):
                wrong.append(("parse error of the wrong class", cls, text, result))
            elif stage == "use" and not (result["runtime"] and result["message"].startswith(
                    "dtorch")):
                wrong.append(("use error that is no dtorch error", cls, text, result))
        assert not wrong, wrong[:20]

        by_variant = {variant: result for variant, result in zip(variants, results)}
        for text, words in refused_at_use.items():
            result = by_variant[("TensorPromise", text)]
            assert result["stage"] == "use" and words in result["message"], (text, result)
            # (Code that filters untrusted input by type catches every one: a ValueError.)
            assert result["invalid_handle"], (text, result)
        for text in altered_options:
            result = by_variant[("TensorPromise", text)]
            assert result["stage"] == "use" and result["invalid_handle"], (text, result)
            assert "value options are not the consumer's" in result["message"], (text, result)
        for cls, text, words in typed_variants:
            result = by_variant[(cls, text)]
            assert result["stage"] == "use" and result["invalid_handle"], (text, result)
            assert words in result["message"], (text, result)
        result = by_variant[("TensorPromise", void_handle)]
        assert result["stage"] == "parse" and result["invalid_handle"], result
        assert "TensorPromise and VoidPromise are not interchangeable" in result["message"]
        assert by_variant[("TensorPromise", "x" * 513)]["invalid_handle"]
        noop = by_variant[("TensorPromise", with_segment("dtorch_1-1-1_" + "0" * 32))]
        assert noop["stage"] == "noop", noop

        # Non-str handles are refused before the library sees them.
        for bad in (handle.encode(), None, 42, [handle]):
            with pytest.raises(TypeError):
                dtorch_ops.TensorPromise.from_serialized(bad)
    finally:
        for name in decoys.values():
            remove_quietly(os.path.join(SHM, name))
        remove_quietly(non_dtorch)

    # Nothing reached the real pairs: still pending; their genuine handles still work.
    assert not real_future.is_ready() and not void_future.is_ready()
    assert not cpu_future.is_ready()
    producer.call(file_workers.produce, handle, 7.0)
    assert real_future.wait(WAIT_MS).tolist() == [7.0] * 16
    producer.call(file_workers.produce, cpu_handle, 8.0)
    assert cpu_future.wait(WAIT_MS).tolist() == [8.0] * 16
    producer.call(file_workers.produce_void, void_handle)
    assert void_future.wait(WAIT_MS) is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options", [{}, {"device": "cpu"}, {"zero_copy": True}],
                         ids=["default", "device_cpu", "zero_copy"])
def test_a_handle_with_other_value_options_is_refused(producer, options):
    """The value options (the consumer's choice of delivery) are bound to the pair: a handle with
    them stripped, changed to another valid option or appended is refused with
    InvalidHandleError (at from_serialized or at first use) before anything is claimed, in a
    producer process and in this one, also once this process is attached through the genuine
    handle. The pair stays pending, and its genuine handle delivers."""
    if options.get("zero_copy") and not dtorch_ops._C.has_device_ipc("cuda"):
        pytest.skip("zero_copy needs a dtorch_ops built with CUDA")
    promise = dtorch_ops.TensorPromise(kind="file", **options)
    future = promise.get_future()
    handle = promise.serialize()
    variants = with_other_value_options(handle)
    assert len(variants) == len(VALUE_OPTIONS) - 1

    def refused_here(text):
        with pytest.raises(errors.InvalidHandleError):
            dtorch_ops.TensorPromise.from_serialized(text).set_value(torch.ones(1))

    for text in variants:
        with pytest.raises(errors.InvalidHandleError):
            producer.call(file_workers.produce, text, 1.0)
        refused_here(text)
    # This process attached through the genuine handle (serializing a deserialized copy uses it,
    # claiming nothing): a tampered handle of the same segment is still checked, not served the
    # attachment.
    genuine = dtorch_ops.TensorPromise.from_serialized(handle)
    assert genuine.serialize() == handle
    for text in variants:
        refused_here(text)

    assert not future.is_ready()
    producer.call(file_workers.produce, handle, 3.0)
    assert future.wait(WAIT_MS).tolist() == [3.0] * 16
    del genuine
