"""The planner: memory, time and communication of a layout before launch (megaframe-plan)."""
