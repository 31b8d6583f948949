"""Benchmark problems shipped with stare (AIME 2024 and AIME 2025, 30 problems each); SOURCES.txt says where each
file comes from and under which licence. Read through ``stare.eval.data.load_bench``."""
