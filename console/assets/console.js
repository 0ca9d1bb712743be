// Progressive enhancement only: every page works without it.
document.addEventListener("change", function (e) {
  if (e.target.matches("input.all")) {
    e.target.form.querySelectorAll('input[name="ref"]').forEach(function (c) { c.checked = e.target.checked; });
  }
});
document.addEventListener("submit", function (e) {
  var msg = e.target.getAttribute("data-confirm");
  if (msg && !window.confirm(msg)) { e.preventDefault(); }
});
