"""Treatment: findings, the fixes they offer (as data: change specs), and the planner that keeps one
coherent plan of them."""
