"""The VRAM expert cache: arena, sizing, the cached MoE experts, profiles, the prompt loan and
routing traces (see docs/architecture.md, "The expert cache")."""
