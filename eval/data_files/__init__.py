"""Benchmark problems shipped with stare (AIME 2024, AIME 2025, AMC 2023, MATH-500); SOURCES.txt says where each
file comes from and under which licence. Read through ``stare.eval.data.load_bench``."""
