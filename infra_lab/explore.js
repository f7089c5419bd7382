/* infra_lab explorer, static face: switch between frames precomputed when the page was built. */
(function (root) {
  if (!root || root.dataset.ready) return;
  root.dataset.ready = "1";
  var frames = JSON.parse(root.querySelector(".infra-lab-explorer-frames").textContent);
  var image = root.querySelector(".infra-lab-explorer-frame");
  var controls = Array.prototype.slice.call(root.querySelectorAll("[data-axis]"));
  function show() {
    var key = controls.map(function (control) {
      if (control.type === "range") {
        control.nextElementSibling.textContent = JSON.parse(control.dataset.labels)[control.value];
      }
      return control.value;
    }).join(",");
    image.src = "data:image/svg+xml;charset=utf-8," + encodeURIComponent(frames[key]);
    image.dataset.key = key;
  }
  controls.forEach(function (control) {
    control.addEventListener("input", show);
    control.addEventListener("change", show);
  });
  show();
})(document.currentScript && document.currentScript.parentElement);
