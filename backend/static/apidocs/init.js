// Starts Swagger UI on the API docs page (backend/templates/apidocs/docs.html). A file, not an inline
// script: the page's Content-Security-Policy runs scripts from this origin only.
window.addEventListener("DOMContentLoaded", function () {
  var root = document.getElementById("swagger-ui");
  window.ui = SwaggerUIBundle({
    url: root.getAttribute("data-spec-url"),
    domNode: root,
    deepLinking: true,
    validatorUrl: null,
  });
});
